"""Attention planned on fake tensors for a GPU: the kernel CUDA runs (flash / memory-efficient), linear in the
sequence, its backward workspace held; attention that is quadratic on the GPU is told in the plan's notes."""

import functools

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn import functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_remat import ProfileOptions, profile_step
from lightning_remat.runtime.targets.fake_attention import cuda_attention, cuda_kernel

transformers = pytest.importorskip("transformers")


@functools.lru_cache(maxsize=None)
def _planned(impl: str, n: int, mask: str | None = None) -> tuple[int, tuple[str, ...]]:
    """(bytes the layer keeps for backward, the profile's notes): a 1-layer Llama on a fake H100 in bf16."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=n,
                                      use_cache=False, attn_implementation=impl)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (1, n))
    attention_mask = torch.ones(1, n, dtype=torch.long)
    attention_mask[0, :3] = 0 if mask == "padded" else 1
    kwargs = {"attention_mask": attention_mask} if mask else {}
    profile = profile_step(model, lambda m: m(input_ids=ids, labels=ids, **kwargs).loss,
                           options=ProfileOptions(fake=True, gpu="h100", dtype=torch.bfloat16))
    return profile.stages[0].option("keep").stored_bytes, profile.notes


def _attention_notes(notes):
    return [note for note in notes if "computes attention as" in note]


def test_sdpa_attention_planned_for_an_h100_is_linear_in_the_sequence():
    """Causal SDPA without a mask runs flash attention on the GPU: output and log-sum-exp, O(n). Twice the
    tokens keep twice the bytes (the dropout seed's 24 bytes aside), and the plan has no attention note."""
    short, notes = _planned("sdpa", 64)
    long, _ = _planned("sdpa", 128)
    assert abs(long - 2 * short) <= 64
    assert not _attention_notes(notes)


def test_eager_attention_is_priced_quadratic_and_the_plan_names_the_layer():
    short, _ = _planned("eager", 64)
    long, notes = _planned("eager", 128)
    assert long > 3 * short  # the score and probability matrices: 4x per doubling
    (note,) = _attention_notes(notes)
    # HF's eager softmax runs in float32: batch 1 x 4 heads x 128 x 128 x 4 bytes.
    assert note.startswith("LlamaAttention computes attention as a 128 x 128 matrix (an explicit softmax: eager")
    assert "256.00 KiB per call" in note


def test_a_mask_of_ones_plans_as_no_mask_and_padding_keeps_its_quadratic_bias():
    """A real 2-D mask without padding: Hugging Face passes SDPA is_causal, as on the GPU (flash, linear).
    With padding it builds an n x n mask; the GPU's memory-efficient kernel keeps it as a bf16 bias per call."""
    assert _planned("sdpa", 128, "ones") == _planned("sdpa", 128)
    short, _ = _planned("sdpa", 64, "padded")
    long, notes = _planned("sdpa", 128, "padded")
    linear_short, linear_long = _planned("sdpa", 64)[0], _planned("sdpa", 128)[0]
    # Beyond the linear part: the bias (n x n x 2 bytes) and keys/values repeated to 4 heads for the masked call.
    # (The two kernels' dropout seeds differ by 8 bytes.)
    repeated_kv = lambda n: 2 * 2 * n * 8 * 2  # k and v, 2 more heads, head size 8, bf16
    assert abs(short - linear_short - (64 * 64 * 2 + repeated_kv(64))) <= 8
    assert abs(long - linear_long - (128 * 128 * 2 + repeated_kv(128))) <= 8
    (note,) = _attention_notes(notes)
    assert "LlamaAttention computes attention as a 128 x 128 matrix (an explicit mask" in note and "32.00 KiB" in note


@pytest.mark.parametrize("shape, dtype, mask, expected", [
    ((1, 8, 64, 64), torch.bfloat16, False, "flash"),
    ((1, 8, 64, 256), torch.float16, False, "flash"),
    ((1, 8, 64, 64), torch.bfloat16, True, "efficient"),
    ((1, 8, 64, 64), torch.float32, False, "efficient"),
    ((1, 8, 64, 320), torch.bfloat16, False, "efficient"),  # past flash's 256
    ((1, 8, 64, 60), torch.bfloat16, True, "math"),  # not a multiple of 8 in half precision
    ((1, 8, 64, 64), torch.float64, False, "math"),
    ((8, 64, 64), torch.bfloat16, False, "math"),  # fused kernels take 4-D inputs only
])
def test_the_kernel_cuda_picks(shape, dtype, mask, expected):
    q = torch.empty(shape, dtype=dtype)
    attn_mask = torch.ones(shape[-2], shape[-2], dtype=torch.bool) if mask else None
    assert cuda_kernel(q, q, q, attn_mask, is_causal=not mask) == expected


def _backward_peak(enabled: bool, heads_kv: int = 2, n: int = 1024):
    """(peak bytes of SDPA forward and backward, FLOPs by op) on fake tensors, with and without CUDA's kernels."""
    with FakeTensorMode():
        q = torch.randn(1, 8, n, 64, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, heads_kv, n, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        with cuda_attention(enabled), FlopCounterMode(display=False) as flops:
            tracker = MemTracker()
            tracker.track_external(q, k, v)
            with tracker:
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[q.device]["Total"]
    return peak, {str(op): count for op, count in flops.get_flop_counts()["Global"].items()}


def test_flash_backward_holds_its_workspace_and_counts_its_recomputation():
    """FlashAttention-2's backward allocates a float32 dq accumulator (sequence rounded to 128, head to 32), the
    row sums, and for grouped-query attention dk and dv at the query's 8 heads; they add to the peak."""
    plain, plain_flops = _backward_peak(False)
    cuda, cuda_flops = _backward_peak(True)
    n, workspace = 1024, 1 * 8 * 1024 * 4 + 1024 * 8 * 64 * 4 + 2 * 1024 * 8 * 64 * 2
    assert plain + workspace <= cuda <= plain + workspace + 64  # (and the dropout seed, 24 bytes)
    # The backward recomputes the scores: 5 matmuls to the forward's 2 (torch counts causal as full).
    forward = cuda_flops["aten._scaled_dot_product_flash_attention"]
    assert forward == 2 * (2 * 8 * n * n * 64)
    assert sum(cuda_flops.values()) == sum(plain_flops.values())  # the CPU kernel counted alike
    assert cuda_flops["aten._scaled_dot_product_flash_attention_backward"] == forward * 5 // 2


class _OddHeadAttention(torch.nn.Module):
    """Attention with a head size (60) that neither fused kernel takes with a mask in bf16: CUDA runs math."""

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_the_gpu_runs_in_the_math_kernel_is_priced_quadratic_and_noted():
    from lightning_remat.runtime.targets.fake_attention import AttentionNotes

    def kept(n: int, notes: AttentionNotes) -> int:
        with FakeTensorMode():
            q, k, v = (torch.empty(1, 2, n, 60, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            mask = torch.ones(n, n, dtype=torch.bool)
            saved = {}
            with cuda_attention(True, notes), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(id(t), t), lambda t: t):
                _OddHeadAttention()(q, k, v, mask)
            return sum(t.untyped_storage().nbytes() for t in saved.values())

    notes = AttentionNotes()
    short, long = kept(64, notes), kept(128, notes)
    # Beyond linear growth: at least the probabilities, 2 heads x n x n in bf16 (4x per doubling).
    assert long - 2 * short >= 2 * (2 * 64 * 64 * 2)
    (note,) = notes.lines()
    assert note.startswith("_OddHeadAttention computes attention as a 64 x 64 matrix (SDPA's math kernel on the GPU)")


def test_a_recomputed_attention_keeps_nothing_for_its_backward_workspace():
    """The workspace hooks live as long as the graph: they must not hold the kernel's output, or a
    checkpointed layer would keep it (a 8B plan at 32K once needed 72.97 GiB instead of 30.15)."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    outputs = []

    def attention(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        outputs.append(weakref.ref(out))
        return out * 2

    with FakeTensorMode():
        q, k, v = (torch.randn(1, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with cuda_attention(True):
            loss = checkpoint(attention, q, k, v, use_reentrant=False).sum()
            gc.collect()
            assert outputs[0]() is None
            loss.backward()  # recomputed, the workspace held and freed
    assert q.grad is not None and q.grad.shape == q.shape
