"""The Triton block-sparse kernel, run on CPU in Triton's interpreter (``TRITON_INTERPRET=1``).

Parity: forward output and the q/k/v (and rpe) gradients of the Triton kernel equal the
PyTorch block-sparse kernel and dense ``scaled_dot_product_attention`` masked to the layout,
in fp32 within ``TOL``. Sizes are small (seq 64-128, block 16, 2 heads, head_dim 16) because
the interpreter runs every program in Python. Triton reads ``TRITON_INTERPRET`` when a kernel
is decorated, so the ``interpreted`` fixture sets it and (re)imports the kernel module, and
restores both afterwards so later users get compiled kernels.

Kernel selection (auto/forced, env variable, errors, import without Triton) is tested here
too; those tests do not need Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardspeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    FixedSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
    build_plan,
    kernel_choice,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton, or the 'test' extra)"
)

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32; observed differences are ~1e-6
H, D, BLOCK = 2, 16, 16
TRITON_GRAD = "_TritonBlockSparseAttentionBackward"
TORCH_GRAD = "_BlockSparseAttentionBackward"


@pytest.fixture(scope="module")
def interpreted():
    """Triton kernels built for the CPU interpreter while this module's tests run.

    Triton decorates its own helpers (``tl.zeros``, ...) when it is first imported, so the
    interpreter works only if ``TRITON_INTERPRET=1`` is set before that: nothing else in the
    suite imports ``triton``, and this fixture sets it before the first import.
    """
    from importlib.metadata import version

    found = tuple(int(x) for x in version("triton").split("+")[0].split(".")[:3])
    if found < (3, 7, 1):  # e.g. the triton a CUDA build of torch pins
        pytest.skip(f"triton {found} < 3.7.1: its interpreter mishandles scalar loads")
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    kernels = importlib.import_module("shardspeed.ops.sparse_attention.triton_kernels")
    if not kernels.INTERPRETED:  # our kernels, imported earlier in compiled mode
        importlib.reload(kernels)
    if not kernels.INTERPRETED:
        patch.undo()
        pytest.skip(
            "triton was imported in compiled mode before this module could set "
            "TRITON_INTERPRET=1; run this file on its own or with TRITON_INTERPRET=1"
        )
    yield
    patch.undo()  # subprocesses started later import triton compiled again


def make_config(name: str, attention: str):
    if name == "fixed":
        return FixedSparsityConfig(H, block=BLOCK, num_local_blocks=2, attention=attention)
    if name == "bigbird":
        return BigBirdSparsityConfig(
            H, block=BLOCK, different_layout_per_head=True, num_random_blocks=1,
            num_sliding_window_blocks=3, attention=attention, seed=4,
        )  # fmt: skip
    return VariableSparsityConfig(
        H, block=BLOCK, num_random_blocks=1, local_window_blocks=[1, 2],
        global_block_indices=[0], attention=attention, seed=5,
    )  # fmt: skip


def make_inputs(batch: int, seq: int, seed: int = 0, head_dim: int = D):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, seq, head_dim, generator=gen).requires_grad_() for _ in range(3)]


def layout_bias(layout: torch.Tensor, block: int) -> torch.Tensor:
    """(H, L, L) additive bias: 0 inside the layout's blocks, -inf outside."""
    allowed = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def grads(out, tensors, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.autograd.grad(out, tensors, torch.randn(out.shape, generator=gen))


def assert_all_close(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@needs_triton
@pytest.mark.parametrize("attention", ["bidirectional", "unidirectional"])
@pytest.mark.parametrize("name,seq", [("fixed", 128), ("bigbird", 128), ("variable", 64)])
def test_triton_matches_pytorch_kernel_and_dense_sdpa(interpreted, name, seq, attention):
    layout = make_config(name, attention).make_layout(seq)
    assert 0 < layout.count_nonzero() < layout.numel()  # really sparse
    q, k, v = make_inputs(1, seq)

    out = block_sparse_attention(q, k, v, layout, kernel="triton")
    assert type(out.grad_fn).__name__ == TRITON_GRAD
    ref = block_sparse_attention(q, k, v, layout, kernel="torch")
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=layout_bias(layout, BLOCK))

    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, dense, **TOL)
    got = grads(out, [q, k, v])
    assert_all_close(got, grads(ref, [q, k, v]))
    assert_all_close(got, grads(dense, [q, k, v]))


@needs_triton
@pytest.mark.parametrize("rpe_batch", [1, 2])
def test_masks_and_rpe_through_the_module(interpreted, rpe_batch):
    """Module path (mask modes, broadcast rpe): the rpe gradient is reduced like autograd's."""
    seq, batch = 64, 2
    config = make_config("fixed", "unidirectional")
    attn = SparseSelfAttention(
        config, key_padding_mask_mode="mul", attn_mask_mode="add", max_seq_length=seq,
        kernel="triton",
    )  # fmt: skip
    q, k, v = make_inputs(batch, seq, seed=2)
    gen = torch.Generator().manual_seed(3)
    rpe = torch.randn(rpe_batch, H, seq, seq, generator=gen).requires_grad_()
    kp = torch.ones(batch, 1, 1, seq)  # DeepSpeed's (B, 1, 1, L) form
    kp[1, ..., 20:] = 0
    am = torch.randn(seq, seq, generator=gen)

    out = attn(q, k, v, rpe=rpe, key_padding_mask=kp, attn_mask=am)
    assert type(out.grad_fn).__name__ == TRITON_GRAD
    kp_bias = torch.zeros(batch, seq).masked_fill(kp.view(batch, seq) == 0, float("-inf"))
    ref = block_sparse_attention(
        q, k, v, attn.get_layout(seq), rpe=rpe, key_padding_bias=kp_bias, attn_bias=am,
        kernel="torch",
    )  # fmt: skip
    bias = layout_bias(attn.get_layout(seq), BLOCK) + rpe + kp_bias[:, None, None, :] + am
    dense = torch.softmax(q @ k.transpose(-1, -2) * D**-0.5 + bias, dim=-1) @ v

    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, dense, **TOL)
    got = grads(out, [q, k, v, rpe])
    assert got[3].shape == rpe.shape
    assert_all_close(got, grads(ref, [q, k, v, rpe]))
    assert_all_close(got, grads(dense, [q, k, v, rpe]))


@needs_triton
def test_empty_rows_give_zeros_and_zero_gradients(interpreted):
    """A layout row with no block and a fully masked row: zeros, as the PyTorch kernel."""
    seq = 64
    layout = make_config("fixed", "bidirectional").make_layout(seq)
    layout[0, 2] = 0  # head 0, query block 2 attends to nothing
    q, k, v = make_inputs(1, seq, seed=6)
    kp_bias = torch.zeros(1, seq)
    attn_bias = torch.zeros(seq, seq)
    attn_bias[5] = float("-inf")  # query row 5 sees no key
    kwargs = dict(key_padding_bias=kp_bias, attn_bias=attn_bias)
    out = block_sparse_attention(q, k, v, layout, kernel="triton", **kwargs)
    ref = block_sparse_attention(q, k, v, layout, kernel="torch", **kwargs)
    assert bool(out[0, 0, 32:48].eq(0).all()) and bool(out[0, :, 5].eq(0).all())
    torch.testing.assert_close(out, ref, **TOL)
    got = grads(out, [q, k, v])
    assert bool(got[0][0, 0, 32:48].eq(0).all())
    assert all(bool(torch.isfinite(g).all()) for g in got)
    assert_all_close(got, grads(ref, [q, k, v]))


@needs_triton
def test_head_dim_padding_and_a_reused_plan(interpreted):
    """head_dim 24 runs padded to a 32-wide tile; a plan serves repeated calls."""
    seq = 64
    plan = build_plan(make_config("bigbird", "bidirectional").make_layout(seq))
    q, k, v = make_inputs(2, seq, seed=7, head_dim=24)
    for _ in range(2):
        out = block_sparse_attention(q, k, v, plan, kernel="triton")
    ref = block_sparse_attention(q, k, v, plan, kernel="torch")
    torch.testing.assert_close(out, ref, **TOL)
    assert_all_close(grads(out, [q, k, v]), grads(ref, [q, k, v]))


@needs_triton
def test_lookup_tables_are_csr_of_the_layout_and_of_its_transpose(interpreted):
    from shardspeed.ops.sparse_attention.triton_attention import build_lookup_tables

    layout = torch.tensor([[[1, 0, 1], [0, 1, 0], [1, 1, 0]]])  # (1 head, 3, 3)
    tables = build_lookup_tables(layout, torch.device("cpu"))
    assert tables.row_ptr.tolist() == [0, 2, 3, 5]
    assert tables.col_idx.tolist() == [0, 2, 1, 0, 1]
    assert tables.col_ptr.tolist() == [0, 2, 4, 5]
    assert tables.row_idx.tolist() == [0, 2, 1, 2, 0]
    split = build_lookup_tables(layout[:, :2, :2], torch.device("cpu"), split=2)
    # [[1, 0], [0, 1]] cut into 2x2 tiles: a block-diagonal of two 2x2 blocks of ones
    assert split.row_ptr.tolist() == [0, 2, 4, 6, 8]
    assert split.col_idx.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]


@needs_triton
def test_large_head_dim_splits_layout_blocks_into_smaller_tiles(interpreted):
    """head_dim 136 (> 128) uses 32-wide tiles, so each 64-token layout block is 2x2 tiles."""
    seq = 192
    layout = FixedSparsityConfig(H, block=64, num_local_blocks=1).make_layout(seq)
    q, k, v = make_inputs(1, seq, seed=8, head_dim=136)
    out = block_sparse_attention(q, k, v, layout, kernel="triton")
    ref = block_sparse_attention(q, k, v, layout, kernel="torch")
    torch.testing.assert_close(out, ref, **TOL)
    assert_all_close(grads(out, [q, k, v]), grads(ref, [q, k, v]))


@needs_triton
def test_env_variable_forces_the_kernel(interpreted, monkeypatch):
    seq = 64
    attn = SparseSelfAttention(make_config("fixed", "bidirectional"), max_seq_length=seq)
    q, k, v = make_inputs(1, seq)
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "triton")
    assert type(attn(q, k, v).grad_fn).__name__ == TRITON_GRAD
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "torch")
    assert type(attn(q, k, v).grad_fn).__name__ == TORCH_GRAD


@needs_triton
@pytest.mark.parametrize(
    "dtype,block,match",
    [(torch.float64, 16, "dtype torch.float64"), (torch.float32, 8, "block size 8")],
)
def test_forced_triton_refuses_what_it_cannot_run(interpreted, dtype, block, match):
    seq = 64
    layout = FixedSparsityConfig(H, block=block, num_local_blocks=2).make_layout(seq)
    q = torch.randn(1, H, seq, D, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        block_sparse_attention(q, q, q, layout, kernel="triton")
    # auto on CPU stays on the PyTorch kernel for the same call
    block_sparse_attention(q, q, q, layout, kernel="auto")


def test_auto_on_cpu_runs_the_pytorch_kernel(monkeypatch):
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    layout = make_config("fixed", "bidirectional").make_layout(64)
    q, k, v = make_inputs(1, 64)
    assert type(block_sparse_attention(q, k, v, layout).grad_fn).__name__ == TORCH_GRAD


def test_auto_on_cuda_picks_triton_or_logs_the_fallback(monkeypatch, caplog):
    """The selection rule, with the device and Triton's availability stubbed."""
    monkeypatch.delenv(kernel_choice.KERNEL_ENV, raising=False)
    cuda_query = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(kernel_choice, "triton_unsupported", lambda query, block: None)
    assert kernel_choice.choose_kernel(None, cuda_query, 16) == "triton"
    assert kernel_choice.choose_kernel("torch", cuda_query, 16) == "torch"
    cpu_query = SimpleNamespace(is_cuda=False)
    assert kernel_choice.choose_kernel("auto", cpu_query, 16) == "torch"
    assert kernel_choice.choose_kernel("triton", cpu_query, 16) == "triton"

    reason = "triton cannot be imported (stubbed)"
    kernel_choice._log_fallback_once.cache_clear()
    monkeypatch.setattr(kernel_choice, "triton_unsupported", lambda query, block: reason)
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        assert kernel_choice.choose_kernel("auto", cuda_query, 16) == "torch"
    assert reason in caplog.text
    with pytest.raises(ValueError, match="stubbed.*kernel='torch'"):
        kernel_choice.choose_kernel("triton", cuda_query, 16)


def test_bad_kernel_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="kernel='cuda'.*'auto', 'triton', 'torch'"):
        kernel_choice.requested_kernel("cuda")
    monkeypatch.setenv(kernel_choice.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=f"{kernel_choice.KERNEL_ENV}='fast'"):
        kernel_choice.requested_kernel(None)
    with pytest.raises(ValueError, match="kernel='dense'"):
        SparseSelfAttention(make_config("fixed", "bidirectional"), kernel="dense")


def test_package_imports_and_runs_without_triton():
    """With ``triton`` unimportable the package imports, auto runs, forcing Triton explains."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import torch
        from shardspeed.ops.sparse_attention import FixedSparsityConfig, block_sparse_attention
        layout = FixedSparsityConfig(2, block=16, num_local_blocks=2).make_layout(64)
        q = torch.randn(1, 2, 64, 16)
        block_sparse_attention(q, q, q, layout)
        try:
            block_sparse_attention(q, q, q, layout, kernel="triton")
        except ValueError as err:
            assert "pip install triton" in str(err), err
        else:
            raise AssertionError("forcing Triton without it should raise")
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != kernel_choice.KERNEL_ENV}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


COMPILE_FOR_GPU = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shardspeed.ops.sparse_attention import triton_kernels as kernels
from shardspeed.ops.sparse_attention.triton_attention import _launch_options

assert not kernels.INTERPRETED
dtype, tile, block_d, arch = {dtype}, {tile}, {block_d}, {arch}
options = _launch_options(tile, block_d, dtype)
element = {{torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}}[dtype]
pointers = {{name: "*" + element for name in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")}}
pointers.update({{name: "*i32" for name in ("RowPtr", "ColIdx", "ColPtr", "RowIdx")}})
constants = dict(BLOCK=tile, BLOCK_D=block_d, HAS_RPE=True, HAS_KP=True, HAS_AM=True,
                 DOT_PRECISION="ieee")
for fn in (kernels.block_sparse_forward, kernels.block_sparse_backward_dq,
           kernels.block_sparse_backward_dkdv):
    consts = dict(constants, WRITE_DRPE=True) if "WRITE_DRPE" in fn.arg_names else constants
    signature = {{
        name: "constexpr" if name in consts else pointers.get(name, "*fp32" if name[0].isupper()
        else "fp32" if name == "scale" else "i32")
        for name in fn.arg_names
    }}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm["cubin"], fn.__name__
    assert compiled.metadata.shared <= 166912, (fn.__name__, compiled.metadata.shared)
print("ok")
"""


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize(
    "dtype,tile,block_d,arch", [("torch.float16", 64, 64, 80), ("torch.bfloat16", 32, 256, 90)]
)
def test_kernels_compile_for_gpus_without_one(dtype, tile, block_d, arch):
    """Compiled (not interpreted) kernels lower to a cubin for sm_80/sm_90 with Triton's own
    ptxas, and fit an A100's shared memory (163 KiB) with the chosen pipeline stages."""
    script = COMPILE_FOR_GPU.format(dtype=dtype, tile=tile, block_d=block_d, arch=arch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


CUDA_PARITY = """
import torch
from shardspeed.ops.sparse_attention import FixedSparsityConfig, block_sparse_attention

torch.backends.cuda.matmul.allow_tf32 = False
seq, head_dim, block = 1024, {head_dim}, {block}
layout = FixedSparsityConfig(4, block=block, num_local_blocks=4).make_layout(seq)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, seq, head_dim, device="cuda", generator=gen, dtype=dtype)
        .requires_grad_()
        for _ in range(3)
    )
    out = block_sparse_attention(q, k, v, layout)  # auto
    assert type(out.grad_fn).__name__ == "{triton_grad}", out.grad_fn
    ref = block_sparse_attention(q, k, v, layout, kernel="torch")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v], grad)
    want = torch.autograd.grad(ref, [q, k, v], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)
print("ok")
"""


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("block,head_dim", [(64, 64), (128, 128), (32, 160)])
def test_cuda_auto_selects_triton_and_matches_the_pytorch_kernel(block, head_dim):
    """Compiled kernels on CUDA, in a fresh process (this one may hold interpreted Triton)."""
    script = CUDA_PARITY.format(block=block, head_dim=head_dim, triton_grad=TRITON_GRAD)
    drop = ("TRITON_INTERPRET", kernel_choice.KERNEL_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
