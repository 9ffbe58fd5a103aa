"""Optional C++ kernels for the CPU, compiled on first use; every caller keeps a pure-PyTorch path.

::

    block_topk(query (M, r), keys (J, r), first (M,), last (M,), k) -> (M, k)   csrc/block_topk.cpp
        the k best blocks of every row by <query, key> in [first, last), best first, -1: fewer qualify
    ssm_step(x (b, D), conv, ssm, *SelectiveSSM parameters) -> (y, conv', ssm')   csrc/step_kernels.cpp
        one step of every chain's selective SSM recurrence (SelectiveSSM.step)
    feed_forward(x (n, C), ptr, norm_weight, norm_bias, eps, fc_weights, fc_biases, proj_weights, proj_biases)
                 -> (n, C)
        proj_s(gelu(fc_s(layer_norm(x)))) on each row segment s of a generation step's few rows (FeedForward,
        PatchExperts)
    block_tail(x (n, C), ptr, norm_weight, norm_bias, eps, fc_weights, fc_biases, proj_weights, proj_biases,
               broadcast_weight, T) -> (n, C)
        x + feed_forward(x, ...), then the first T rows += broadcast_weight @ the last T (SheafBlock.step's tail)
    stream_pools(query, keys, sources, types, type_bias, sink, k, root, sink_threshold, block_query, block_key,
                 stream, last, token_rows, num_blocks, block_size, content_type, first_dst)
                 -> (source, dst, type, weight), (M k,) each
        the competition of a stream batch's new outputs, content proposals included, as the edges into them
        (LearnedTopology.compete_outputs, sheafgnn.nn.topology_step)
    stream_keys(h (N, D), state (R, D), previous_row (T,), no_previous (T,), num_rows, query_weight, key_weight,
                key_previous_weight) -> (query (N, r), key (num_rows, r))
        the learned topology's queries and keys of a stream batch's new nodes (LearnedTopology.queries_and_keys)
    glue_diag(x (N, D), src, ptr, edge_type, edge_weight, map_lin, map_type_emb, weight_channel, eps, x_src,
              map_offset) -> (N, D)
        SheafConv with diag maps in inference, edges sorted by destination, sources in x_src (bipartite) or x
        (SheafConv.forward)

A kernel's caller reads ~10 parameters and submodules of its layer per call, and each nn.Module attribute lookup
costs 0.5-1 us of Python (a generation step made ~200 of them): :func:`registered` keeps them on the layer
until any module registers a parameter, buffer or submodule.

The sources are compiled by :func:`torch.utils.cpp_extension.load_inline` (ninja and a C++ compiler: about
40 s once, then cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) with
``-march=native``, so the build directory is named for this CPU's instruction set and for the source's text.
The text, local headers inlined, is written into that directory: ninja rebuilds when a compile command
changes, and a command naming the checkout's own path made two checkouts (a git worktree, a clone) rebuild
each other's kernels on every first use. Where a build fails
(no compiler, or no ninja: ``pip install 'sheafgnn[kernels]'``) the first failure warns once, saying why, and
the callers run their PyTorch paths, which compute the same; set ``SHEAFGNN_CPU_KERNELS=0`` to use those paths
always (tests compare the two).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as _module

from sheafgnn.nn.norm_linear import fusable_norm
from sheafgnn.optional import install_hint

_SOURCES = Path(__file__).parent / "csrc"
# The step kernels' callers use them up to this many rows (per stream): a generation step's. Above, MKL's matmuls
# (FeedForward: 14 against 42 us at 1 row, 226 against 116 us at 64) and best_blocks' tiled kernel win.
STEP_ROWS = 16


def enabled() -> bool:
    """Whether the kernels may be used (``SHEAFGNN_CPU_KERNELS`` is not ``0``)."""
    return os.environ.get("SHEAFGNN_CPU_KERNELS", "1") != "0"


def _cpu_tag() -> str:
    """A short name for this CPU's instruction set: kernels built with ``-march=native`` on one CPU may not
    run on another, so each gets its own build directory."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


_failed: list[str] = []  # sources whose build failed in this process; the first failure warns, the rest are silent


def _source_text(name: str) -> str:
    """``csrc/<name>.cpp`` with its local headers (``#include "top_list.h"``) inlined."""
    return re.sub(r'^#include "([\w.]+)"$', lambda include: (_SOURCES / include[1]).read_text().rstrip("\n"),
                  (_SOURCES / f"{name}.cpp").read_text(), flags=re.MULTILINE)


@functools.cache
def _load(name: str):
    from torch.utils.cpp_extension import load_inline

    try:
        text = _source_text(name)
        tag = hashlib.sha1(f"{_cpu_tag()} {text}".encode()).hexdigest()[:8]
        return load_inline(name=f"sheafgnn_{name}_{tag}", cpp_sources=[text], no_implicit_headers=True,
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           verbose=False)
    except Exception as err:  # no compiler, no ninja, a failed build: the PyTorch path is used instead
        if not _failed:  # another source fails for the same reason: one warning says it
            warnings.warn(f"sheafgnn: the C++ kernel {name!r} could not be built ({type(err).__name__}: "
                          f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}); using the PyTorch "
                          f"paths, which compute the same. Install a C++ compiler and ninja "
                          f"({install_hint('ninja')}), or set SHEAFGNN_CPU_KERNELS=0 to skip the build.",
                          RuntimeWarning, stacklevel=3)
        _failed.append(name)
        return None


def kernel_inputs(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernels read ``x`` as its PyTorch path would: inference (no gradients), a CPU tensor of
    float32 or float64, in the weights' ``dtype``. Each caller adds what its own layer needs."""
    return not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) \
        and x.dtype == dtype


# Parameters, buffers and submodules registered (assigned) in any module since the first registered() call;
# None until then: importing this module installs no hook (torch.nn's hooks are process-wide).
_registrations: int | None = None


def _registered_one(*args) -> None:
    global _registrations
    _registrations += 1


def _registration_count() -> int:
    """The registrations so far, counted from the first call on (which installs torch.nn's global hooks)."""
    global _registrations
    if _registrations is None:
        _registrations = 0
        for hook in (_module.register_module_parameter_registration_hook,
                     _module.register_module_buffer_registration_hook,
                     _module.register_module_module_registration_hook):
            hook(_registered_one)
    return _registrations


def registered(layer: nn.Module, names: tuple[str, ...]) -> tuple:
    """The parameters, buffers and submodules of ``layer`` at the dotted paths ``names`` (e.g.
    ``("in_proj", "in_proj.weight")``; None where one is None), as ``getattr`` gives them.

    They are kept on the layer until any module registers or replaces a parameter, buffer or submodule (the
    global registration hooks of :mod:`torch.nn`): in-place changes (optimizer steps, ``load_state_dict``,
    ``.to()``) keep the same objects, so the tuple stays right. Not kept while
    ``torch.__future__.get_overwrite_module_params_on_conversion()`` is on (``.to()`` then swaps parameters
    without registering them). Plain attributes (``eps``, flags) are not cached: read them from the objects.
    """
    cache, count = layer.__dict__.get("_sheafgnn_registered"), _registration_count()
    if cache is None or cache[0] != count or torch.__future__.get_overwrite_module_params_on_conversion():
        cache = layer.__dict__["_sheafgnn_registered"] = (count, {})
    found = cache[1].get(names)
    if found is None:
        found = cache[1][names] = tuple(functools.reduce(getattr, name.split("."), layer) for name in names)
    return found


def norm_arguments(x: torch.Tensor, norm: nn.Module | None) -> tuple | None:
    """A kernel's arguments for its input's LayerNorm ``norm``: (weight, bias, eps); empty tensors and 0 for no
    norm; None for a norm the kernels do not compute (not an affine :class:`~torch.nn.LayerNorm` with bias)."""
    if norm is None:
        return x.new_empty(0), x.new_empty(0), 0.0
    return (*registered(norm, ("weight", "bias")), norm.eps) if fusable_norm(norm) else None


def _kernel(source: str, name: str):
    if not enabled():
        return None
    module = _load(source)
    return None if module is None else getattr(module, name)


def block_topk():
    """The ``block_topk`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("block_topk", "block_topk")


def ssm_step():
    """The ``ssm_step`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "ssm_step")


def feed_forward():
    """The ``feed_forward`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "feed_forward")


def block_tail():
    """The ``block_tail`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "block_tail")


def glue_diag():
    """The ``glue_diag`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "glue_diag")


def stream_pools():
    """The ``stream_pools`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "stream_pools")


def stream_keys():
    """The ``stream_keys`` kernel (see the module docstring), or None: disabled or not buildable."""
    return _kernel("step_kernels", "stream_keys")
