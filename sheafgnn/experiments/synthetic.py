r"""The paper's synthetic language: byte sequences with a known, sparse, typed dependency graph G*.

::

    generate(n, seed) -> SyntheticSequence      ids (n,), G* = (src, dst, type) (D,)
    score_dense(seq), score_window(seq, w)      attention, scored analytically against G*
    score_site(seq, site, hops)                 a site's relation graph scored against G*
    PAPER                                       the paper's figures for this simulation

**The generator** (:func:`generate`). A structural causal model over bytes,
laid out as text so that the site's rules see its structure::

    ### 3\n\n fe qb hgd QRk pj. oin lb TSc ... .  \n### 6\n\n ...

- *sections* open with an instruction line ``### K`` (K a key digit, drawn
  freely) and a blank line; a section closes at the first sentence end after
  about ``section_len`` body tokens;
- *body tokens* follow a 2nd-order rule: the kind of token t (letter, word
  boundary ``' '``, sentence stop ``'.'``, entity name letter, ...) is a
  function of (x[t-2], x[t-1]) and free coins, and its value is
  ``x[t] = F_kind(x[t-2], x[t-1], extra, u[t])`` with F_kind a fixed random
  table (the "language", from ``language_seed``) and ``u[t]`` one of
  ``branching`` free choices (stored in :attr:`SyntheticSequence.choice`);
- *anchored* tokens (the first letter of every sentence) also read the
  section's key: ``letter((T[x[t-2], x[t-1], u] + shift[K]) mod 16)``;
- *entity mentions* are 3-byte words: two name letters (which entity, drawn
  from a table) and a value letter. The first mention of an entity draws the
  value; every later mention *copies* the value of the previous mention, so
  the word recurs verbatim.

The generator's G*, typed: **local** (t-2, t) and (t-1, t) for every body
token (the two inputs of its table); **anchor** (key, t) for every anchored
token; **entity** (value of the previous mention, t) for every repeated value.
Format bytes of the instruction lines and the keys have no sources. G* is
defined by the generator alone, never read off the site. A few local edges
are inputs whose value is fixed by the layout (the first letter of a
sentence always sees ``'. '`` or ``'\n\n'``); they stay in G* as the paper's
model ("each token depends on its two predecessors") has them.

Scoring (relations, coverage, waste, hops) is defined in :mod:`sheafgnn.relations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.relations import coverage_scores, dense_relations, score_graph, site_graph, window_relations
from sheafgnn.site import SiteConfig

# The paper's table at n = 32,768: coverage, waste and edges of dense attention, a local window and
# the sheaf site. The one place its figures are written (its local waste is "~75%").
PAPER = {"dense": {"coverage": 1.0, "waste": 0.9998, "edges": 536_000_000},
         "local": {"coverage": 0.965, "waste": 0.75},
         "sheaf": {"coverage": 1.0, "waste": 0.325, "edges": 100_000}}

LETTERS = b"abcdefghijklmnop"  # body letters; 16 = the modulus of the anchor shift
NAME_LETTERS = b"QRSTUVWX"  # entity name letters (entities = pairs of them)
KEY_LETTERS = b"0123456789"  # instruction keys
_SPACE, _DOT, _NEWLINE = ord(" "), ord("."), ord("\n")  # layout bytes
_LOWER, _UPPER = frozenset(LETTERS), frozenset(NAME_LETTERS)

DEP_TYPES = ("local", "anchor", "entity")


class Kind:
    """Token kinds of the generator (stored per token as uint8)."""

    FORMAT = 0  # bytes of an instruction line ('\n', '#', ' '); no sources
    KEY = 1  # the instruction key; free
    LETTER = 2  # T[a, b, u]
    ANCHORED = 3  # sentence-first letter: T[a, b, u] shifted by the section key
    SPACE = 4  # a word boundary ' '
    STOP = 5  # a sentence stop '.'
    AFTER_STOP = 6  # the ' ' after a stop
    NAME = 7  # an entity name letter: N[a, b, u]
    VALUE_NEW = 8  # first mention's value: V[a, b, u]
    VALUE_COPY = 9  # later mention's value: the previous mention's value

    NAMES = ("format", "key", "letter", "anchored", "space", "stop", "after_stop", "name",
             "value_new", "value_copy")


@dataclass
class GeneratorConfig:
    """Densities of the synthetic sequences; defaults give ~67k dependencies at n = 32,768."""

    section_len: int = 1024  # mean body tokens per instruction section (uniform in [L/2, 3L/2])
    num_keys: int = 8  # distinct instruction keys (<= 10)
    word_end: float = 0.3  # chance a word of >= 2 letters ends after each letter
    sentence_end: float = 0.16  # chance a word boundary is a sentence stop
    mention_rate: float = 0.25  # chance a word (not sentence-first) is an entity mention
    branching: int = 4  # free choices u per table context
    language_seed: int = 0  # seeds the tables (the "language"), shared by all sequences

    def __post_init__(self) -> None:
        if not 1 <= self.num_keys <= len(KEY_LETTERS):
            raise ValueError(f"GeneratorConfig: num_keys must be in [1, {len(KEY_LETTERS)}] (got {self.num_keys})")
        if self.section_len < 16 or self.branching < 1:
            raise ValueError(f"GeneratorConfig: need section_len >= 16 and branching >= 1 "
                             f"(got {self.section_len} and {self.branching})")
        for name in ("word_end", "sentence_end", "mention_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GeneratorConfig: {name} must be in [0, 1) (got {getattr(self, name)})")


@dataclass
class Language:
    """The fixed tables of the generator, indexed by bytes (a, b) = (x[t-2], x[t-1]).

    Attributes:
        letter (np.ndarray): (256, 256, K) letter index in [0, 16) for LETTER/ANCHORED.
        name (np.ndarray): (256, 256, K) name letter index in [0, 8) for NAME.
        value (np.ndarray): (256, 256, K) letter index in [0, 16) for VALUE_NEW.
        shift (np.ndarray): (num_keys,) distinct anchor shifts in [1, 16).
    """

    letter: np.ndarray
    name: np.ndarray
    value: np.ndarray
    shift: np.ndarray


def make_language(config: GeneratorConfig) -> Language:
    """The tables of ``config``'s language (a function of language_seed, branching, num_keys)."""
    rng = np.random.default_rng(config.language_seed)
    k = config.branching
    return Language(
        letter=rng.integers(0, len(LETTERS), (256, 256, k), dtype=np.uint8),
        name=rng.integers(0, len(NAME_LETTERS), (256, 256, k), dtype=np.uint8),
        value=rng.integers(0, len(LETTERS), (256, 256, k), dtype=np.uint8),
        shift=(rng.permutation(len(LETTERS) - 1)[: config.num_keys] + 1).astype(np.uint8),
    )


@lru_cache(maxsize=4)
def _language_lists(language_seed: int, branching: int, num_keys: int) -> tuple[list, list, list, list]:
    """The tables as nested lists, for the generator's scalar loop (cached: tolist is slow)."""
    lang = make_language(GeneratorConfig(num_keys=num_keys, branching=branching, language_seed=language_seed))
    return lang.letter.tolist(), lang.name.tolist(), lang.value.tolist(), lang.shift.tolist()


@dataclass
class SyntheticSequence:
    """A generated sequence and its true dependency graph G*.

    Attributes:
        ids (Tensor): (n,) byte token ids.
        kind (Tensor): (n,) uint8 :class:`Kind` of each token.
        choice (Tensor): (n,) uint8 free choice u of each table token (0 elsewhere).
        key_pos (Tensor): (n,) position of the section key each token sees (-1 before the first).
        src, dst (Tensor): (D,) G* edges, src < dst, distinct pairs.
        dep_type (Tensor): (D,) index into :data:`DEP_TYPES`.
        config (GeneratorConfig): the densities and language seed.
    """

    ids: Tensor
    kind: Tensor
    choice: Tensor
    key_pos: Tensor
    src: Tensor
    dst: Tensor
    dep_type: Tensor
    config: GeneratorConfig

    @property
    def text(self) -> str:
        return bytes(self.ids.to(torch.uint8).numpy()).decode("ascii")

    def dep_counts(self) -> dict[str, int]:
        counts = torch.bincount(self.dep_type, minlength=len(DEP_TYPES)).tolist()
        return {"total": int(self.src.numel()), **dict(zip(DEP_TYPES, counts))}


def generate(n: int, seed: int = 0, config: GeneratorConfig | None = None) -> SyntheticSequence:
    """Generate ``n`` tokens with a known typed dependency graph G* (see the module docstring).

    Deterministic in (n, seed, config); a prefix of a longer sequence with the
    same seed is *not* guaranteed (the layout draws depend on n).

    Args:
        n (int): tokens (bytes) to generate, >= 8.
        seed (int): seeds the layout coins and free choices (default: :obj:`0`).
        config (GeneratorConfig, optional): densities (default: :obj:`GeneratorConfig()`).
    """
    if n < 8:
        raise ValueError(f"generate: n must be >= 8 (got {n})")
    config = config if config is not None else GeneratorConfig()
    tables = _language_lists(config.language_seed, config.branching, config.num_keys)
    rng = np.random.default_rng(seed)
    coin = rng.random((n, 2)).tolist()  # (n, 2) layout coins per position
    choice = rng.integers(0, config.branching, n).tolist()  # (n,) free choices u
    keys = rng.integers(0, config.num_keys, n // 8 + 2).tolist()
    lengths = rng.integers(config.section_len // 2, config.section_len * 3 // 2 + 1, n // 8 + 2).tolist()

    x = [0] * n
    kind = [Kind.FORMAT] * n
    u_out = [0] * n
    key_of = [-1] * n
    src, dst, typ = [], [], []
    last_value: dict[tuple[int, int], int] = {}  # entity (its two name letters) -> position of its last value
    section, key_pos, body, target = -1, -1, 0, 0
    t = 0
    while t < n:
        a, b = (x[t - 2], x[t - 1]) if t >= 2 else (0, 0)
        if t == 0 or (b == _SPACE and a == _DOT and body >= target):  # open a section
            section += 1
            t, key_pos = _write_header(x, kind, key_of, t, KEY_LETTERS[keys[section]], key_pos)
            body, target = 0, lengths[section]
            continue
        u = choice[t]
        key_of[t] = key_pos
        k, v, copied = _body_token(a, b, coin[t], u, t, x[key_pos], last_value, tables, config)
        if copied >= 0:
            v = x[copied]
            src.append(copied), dst.append(t), typ.append(2)
        x[t], kind[t], u_out[t] = v, k, u
        src += [t - 2, t - 1]
        dst += [t, t]
        typ += [0, 0]
        if k == Kind.ANCHORED:
            src.append(key_pos), dst.append(t), typ.append(1)
        body += 1
        t += 1

    order = np.lexsort((np.asarray(src), np.asarray(dst)))  # by dst, then src
    as_long = lambda values: torch.as_tensor(np.asarray(values, dtype=np.int64)[order])
    return SyntheticSequence(
        ids=torch.tensor(x, dtype=torch.long),
        kind=torch.tensor(kind, dtype=torch.uint8),
        choice=torch.tensor(u_out, dtype=torch.uint8),
        key_pos=torch.tensor(key_of, dtype=torch.long),
        src=as_long(src), dst=as_long(dst), dep_type=as_long(typ),
        config=config,
    )


def _write_header(x: list[int], kind: list[int], key_of: list[int], t: int, key: int,
                  key_pos: int) -> tuple[int, int]:
    """Write a section's header at ``t`` (clipped at n): a newline (except at t = 0), the instruction
    line ``### K`` and a blank line. Returns the position after it and the position of its key K."""
    n = len(x)
    header = (b"" if t == 0 else b"\n") + b"### " + bytes([key]) + b"\n\n"
    for offset, byte in enumerate(header):
        if t + offset < n:
            x[t + offset] = byte
            key_of[t + offset] = key_pos  # the header still sees the previous section's key
    key_pos = t + len(header) - 3
    if key_pos < n:
        kind[key_pos] = Kind.KEY
    return t + len(header), key_pos


def _body_token(a: int, b: int, coin: list[float], u: int, t: int, key: int, last_value: dict,
                tables: tuple[list, list, list, list], config: GeneratorConfig) -> tuple[int, int, int]:
    """The kind and value of body token t after bytes (a, b) = (x[t-2], x[t-1]), and the position
    whose value it copies (-1: none; the caller reads the value there). Records entity values in
    ``last_value``."""
    letter, name, value, shift = tables
    if b == _DOT:
        return Kind.AFTER_STOP, _SPACE, -1
    if (a, b) in ((_DOT, _SPACE), (_NEWLINE, _NEWLINE)):
        return Kind.ANCHORED, LETTERS[(letter[a][b][u] + shift[key - KEY_LETTERS[0]]) % len(LETTERS)], -1
    if b == _SPACE and coin[0] < config.mention_rate or b in _UPPER and a == _SPACE:
        return Kind.NAME, NAME_LETTERS[name[a][b][u]], -1
    if b in _UPPER:  # a and b are the entity's name letters
        prev = last_value.get((a, b))
        last_value[(a, b)] = t
        if prev is None:
            return Kind.VALUE_NEW, LETTERS[value[a][b][u]], -1
        return Kind.VALUE_COPY, -1, prev
    if b in _LOWER and (a in _UPPER or (a in _LOWER and coin[0] < config.word_end)):
        return (Kind.STOP, _DOT, -1) if coin[1] < config.sentence_end else (Kind.SPACE, _SPACE, -1)
    return Kind.LETTER, LETTERS[letter[a][b][u]], -1  # a word start or a word's next letter


def matched_site_config() -> SiteConfig:
    """Only the patch types whose rules the generator's structure feeds (the rest stay empty or add noise)."""
    return SiteConfig(patch_types=("local", "sentence", "instruction", "memory", "retrieval"))


# ---------------------------------------------------------------- topologies scored against G*

def score_dense(seq: SyntheticSequence) -> dict:
    """Dense causal attention, analytically: every dependency realised, n(n-1)/2 relations."""
    n = seq.ids.numel()
    out = coverage_scores((seq.src < seq.dst).numpy(), seq.dep_type.numpy(), dense_relations(n), DEP_TYPES)
    out["edges"] = dense_relations(n)
    return out


def score_window(seq: SyntheticSequence, window: int) -> dict:
    """A local window of ``window`` keys, analytically: dependencies with dst - src <= w."""
    n = seq.ids.numel()
    lag = (seq.dst - seq.src).numpy()
    out = coverage_scores((lag >= 1) & (lag <= window), seq.dep_type.numpy(), window_relations(n, window),
                          DEP_TYPES)
    out["edges"] = window_relations(n, window)
    return out


def score_against(graph, seq: SyntheticSequence, hops: int) -> dict:
    """Any relation graph over ``seq``'s tokens scored against its G* (:func:`~sheafgnn.relations.score_graph`)."""
    return score_graph(graph, hops, seq.src.numpy(), seq.dst.numpy(), seq.dep_type.numpy(), DEP_TYPES)


def score_site(seq: SyntheticSequence, data: HeteroData, hops: int, stream: bool = True) -> dict:
    """The sheaf site of ``seq`` (see :func:`~sheafgnn.relations.site_graph`) scored against its G*."""
    return score_against(site_graph(data, stream=stream), seq, hops)
