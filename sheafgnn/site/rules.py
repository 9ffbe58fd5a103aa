"""Causal patch rules on the byte stream, vectorised.

Each rule takes the bytes ``b`` (uint8, (nb,)) and returns byte spans
``(start, end)`` with ``end`` exclusive, where ``end - 1`` is the byte that
*proves* the patch closed. A rule decides a span from bytes before ``end``
alone, so no patch depends on text after it closed. Patches still open at
the end of the text are not emitted: they would change with what follows.

The byte classes (``SPACE``, ``WORD``, ``STOP``: (256,) masks; ``OPEN``/``CLOSE``:
bracket kinds; ``QUOTES``, ``NEWLINE``; ``WORD_HASH``) are shared with the
patch types' incremental scanners (:mod:`sheafgnn.site.patches`), which read the
same bytes one at a time and must decide exactly as these rules do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sheafgnn.site.tokenizer import bytes_tensor

SPACE = torch.zeros(256, dtype=torch.bool)
SPACE[list(b" \t\r\n\v\f")] = True
WORD = torch.zeros(256, dtype=torch.bool)
WORD[list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")] = True
WORD[128:] = True  # UTF-8 lead and continuation bytes: letters outside ASCII
STOP = torch.zeros(256, dtype=torch.bool)
STOP[list(b".!?")] = True
OPEN = {ord("("): 1, ord("["): 2, ord("{"): 3}
CLOSE = {ord(")"): 1, ord("]"): 2, ord("}"): 3}
QUOTES = (ord('"'), ord("`"))  # quote bytes that pair on a line
NEWLINE = ord("\n")


def byte_set(mask: Tensor) -> frozenset[int]:
    """The bytes a (256,) class mask holds: a scanner tests one byte at a time, where a set is faster."""
    return frozenset(torch.nonzero(mask).squeeze(1).tolist())


def _empty() -> tuple[Tensor, Tensor]:
    return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)


def _prev_true_index(mask: Tensor) -> Tensor:
    """For each i, the largest j <= i with mask[j], or -1."""
    idx = torch.where(mask, torch.arange(mask.numel()), -1)
    return idx.cummax(0).values


def sentences(b: Tensor) -> tuple[Tensor, Tensor]:
    """Sentences: closed by ``.``, ``!`` or ``?`` followed by white space, or a blank line.

    The white-space byte after the stop (or the second newline) closes the
    sentence: only then is "3.14" told apart from "end. Next".
    """
    b = b.long()
    if b.numel() < 2:
        return _empty()
    prev, cur = b[:-1], b[1:]
    closes = (STOP[prev] & SPACE[cur]) | ((prev == NEWLINE) & (cur == NEWLINE))
    end = torch.nonzero(closes).squeeze(1) + 2  # (S,) exclusive ends
    start = torch.cat([end.new_zeros(1), end])[:-1]
    return start, end


def brackets(b: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """Balanced ``()``, ``[]``, ``{}`` spans nested at most ``max_depth`` deep.

    Depth is the running count of opens minus closes. An open at depth d and
    the next bracket at the same depth, if it is a close of the same kind,
    form a pair; a pair is decided by the bytes between them alone.
    """
    b = b.long()
    kind = torch.zeros(256, dtype=torch.long)
    for byte, k in OPEN.items():
        kind[byte] = k
    for byte, k in CLOSE.items():
        kind[byte] = -k
    k = kind[b]
    pos = torch.nonzero(k).squeeze(1)  # (K,) bracket positions
    if pos.numel() < 2:
        return _empty()
    k = k[pos]
    is_open = k > 0
    depth_after = is_open.long().mul(2).sub(1).cumsum(0)
    level = torch.where(is_open, depth_after, depth_after + 1)  # (K,)
    # Sort by (level, position): position is already ascending, so a stable sort by level.
    order = torch.sort(level, stable=True).indices
    lv, kk, pp = level[order], k[order], pos[order]
    pair = (lv[:-1] == lv[1:]) & (kk[:-1] > 0) & (kk[1:] == -kk[:-1]) & (lv[:-1] <= max_depth)
    return pp[:-1][pair], pp[1:][pair] + 1


def quotes(b: Tensor) -> tuple[Tensor, Tensor]:
    """Double-quote and backtick spans: the 1st and 2nd quote of a line pair, then the 3rd and 4th..."""
    b = b.long()
    is_quote = (b == QUOTES[0]) | (b == QUOTES[1])
    pos = torch.nonzero(is_quote).squeeze(1)
    if pos.numel() < 2:
        return _empty()
    line = torch.cumsum(b == NEWLINE, 0)[pos]  # (Q,) line of each quote
    first_of_line = torch.ones_like(line, dtype=torch.bool)
    first_of_line[1:] = line[1:] != line[:-1]
    first_idx = _prev_true_index(first_of_line)
    rank = torch.arange(pos.numel()) - first_idx  # rank of the quote within its line
    same_kind = b[pos[:-1]] == b[pos[1:]]
    pair = (rank[:-1] % 2 == 0) & (line[:-1] == line[1:]) & same_kind
    return pos[:-1][pair], pos[1:][pair] + 1


def _lines(b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per line: start byte, first non-space byte (or -1 if blank/unfinished), indent."""
    nb = b.numel()
    start = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(b == NEWLINE).squeeze(1) + 1])
    start = start[start < nb]
    nonspace = ~SPACE[b.long()] | (b == NEWLINE)  # a newline ends a blank line's indent
    # First byte at or after each line start that is not a blank.
    nxt = torch.where(nonspace, torch.arange(nb), nb)
    nxt = nxt.flip(0).cummin(0).values.flip(0)
    first = nxt[start]  # (L,)
    valid = first < nb
    first_byte = b[first.clamp(max=nb - 1)]
    valid &= first_byte != NEWLINE  # blank line
    indent = first - start
    return start, torch.where(valid, first, -1), indent


def indent_blocks(b: Tensor) -> tuple[Tensor, Tensor]:
    """Indentation blocks: a line indented deeper than the previous non-blank line
    opens a block that closes at the first later line indented less than it
    (closed on that line's first non-space byte, which proves the dedent)."""
    if b.numel() < 2:
        return _empty()
    start, first, indent = _lines(b)
    keep = first >= 0
    start, first, indent = start[keep], first[keep], indent[keep]
    if start.numel() < 2:
        return _empty()
    opens = torch.zeros(start.numel(), dtype=torch.bool)
    opens[1:] = indent[1:] > indent[:-1]
    open_idx = torch.nonzero(opens).squeeze(1)
    starts, ends = [], []
    for level in torch.unique(indent[open_idx]).tolist():  # a loop per indent level
        openers = open_idx[indent[open_idx] == level]
        closers = torch.nonzero(indent < level).squeeze(1)  # lines indented less
        j = torch.searchsorted(closers, openers, right=True)
        ok = j < closers.numel()
        starts.append(start[openers[ok]])
        ends.append(first[closers[j[ok]]] + 1)
    if not starts:
        return _empty()
    return torch.cat(starts), torch.cat(ends)


def instructions(b: Tensor, cues: tuple[str, ...]) -> tuple[Tensor, Tensor]:
    """Lines that start with an instruction cue; closed by the line's newline."""
    nb = b.numel()
    if nb == 0 or not cues:
        return _empty()
    b = b.long()
    line_start = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(b == NEWLINE).squeeze(1) + 1])
    line_start = line_start[line_start < nb]
    hit = torch.zeros(line_start.numel(), dtype=torch.bool)
    for cue in cues:  # a loop per cue pattern
        pattern = torch.tensor(list(cue.encode("utf-8")), dtype=torch.long)
        fits = line_start + pattern.numel() <= nb
        idx = (line_start[fits, None] + torch.arange(pattern.numel())).clamp(max=nb - 1)
        match = torch.zeros_like(hit)
        match[fits] = (b[idx] == pattern).all(1)
        hit |= match
    starts = line_start[hit]
    newlines = torch.nonzero(b == NEWLINE).squeeze(1)
    j = torch.searchsorted(newlines, starts)
    ok = j < newlines.numel()
    return starts[ok], newlines[j[ok]] + 1


def words(b: Tensor, min_len: int, max_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Words, identifiers and numbers of at least ``min_len`` bytes, with an entity id.

    A word closes on the first non-word byte after it. Entity keys are equal
    for equal words (compared on their first ``max_len`` <= 64 bytes), a hash
    of the word alone.

    Returns:
        start (W,), end (W,) exclusive (the delimiter included), entity key (W,).
    """
    nb = b.numel()
    if nb < 2:
        s, e = _empty()
        return s, e, s
    w = WORD[b.long()]
    begins = w.clone()
    begins[1:] &= ~w[:-1]
    finishes = w[:-1] & ~w[1:]  # word byte followed by a non-word byte
    start = torch.nonzero(begins).squeeze(1)
    stop = torch.nonzero(finishes).squeeze(1) + 1  # exclusive end of the word itself
    start = start[: stop.numel()]  # the last word may still be open
    length = stop - start
    keep = length >= min_len
    start, stop, length = start[keep], stop[keep], length[keep]
    if start.numel() == 0:
        s, e = _empty()
        return s, e, s
    offsets = torch.arange(max_len)
    idx = start[:, None] + offsets  # (W, max_len)
    inside = offsets < length[:, None]
    padded = torch.where(inside, b.long()[idx.clamp(max=nb - 1)] + 1, 0)  # (W, max_len), 0 = past the end
    return start, stop + 1, (padded * WORD_HASH[:max_len]).sum(1)


# Random odd 31-bit weights: a word's entity key is sum_k (byte_k + 1) * w_k, exact
# in int64 (< 2^44). Distinct words collide only if their weighted byte sums
# agree, which these weights make vanishingly rare; a collision would only add
# a spurious (still causal) recurrence edge.
WORD_HASH = torch.randint(1 << 29, 1 << 31, (64,), generator=torch.Generator().manual_seed(0)) | 1


def split_sentences(text: str) -> list[str]:
    """The closed sentences of ``text`` as strings (by :func:`sentences`)."""
    raw = text.encode("utf-8", errors="surrogatepass")
    start, end = sentences(bytes_tensor(raw))
    return [raw[s:e].decode("utf-8", errors="replace") for s, e in zip(start.tolist(), end.tolist())]
