"""The pinned flash kernels against SDPA on a real GPU.

Needs the pinned snapshots reachable: online, or already in the HF cache when HF_HUB_OFFLINE=1.
A load failure fails the test on purpose: on a CUDA machine it is a real defect, not an environment skip.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fastplms.flash import FLASH_PINS, check_flash_inputs, flash_varlen_forward, load_flash_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = 2e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("implementation", sorted(FLASH_PINS))
def test_varlen_matches_sdpa_per_segment(implementation: str, kv_heads: int, causal: bool) -> None:
    if implementation == "flash_attention_3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("flash-attn3 builds target Hopper (sm90)")
    kernel = load_flash_kernel(implementation)
    lengths, heads, dim = [1, 37, 128, 5, 300], 8, 64
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(n_heads: int) -> torch.Tensor:
        return torch.randn(sum(lengths), n_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    out = flash_varlen_forward(kernel, q, k, v, cu, cu, max(lengths), max(lengths), scale=scale, causal=causal)
    assert out.shape == q.shape and out.dtype == torch.bfloat16

    worst = 0.0
    for start, end in itertools.pairwise(cu.tolist()):
        # fp32 reference on the same bf16 inputs, so the error measured is the kernel's alone.
        seg_q, seg_k, seg_v = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(
            seg_q, seg_k, seg_v, scale=scale, is_causal=causal, enable_gqa=kv_heads != heads
        )
        err = (out[start:end].float() - ref.transpose(0, 1)).abs().max().item()
        worst = max(worst, err)
    print(f"{implementation} kv_heads={kv_heads} causal={causal}: max abs error {worst:.3e}")
    assert worst < TOLERANCE, f"{implementation}: max abs error {worst:.3e} >= {TOLERANCE}"


def test_input_checks_on_real_cuda_tensors() -> None:
    bf16 = torch.zeros(2, 4, 5, 8, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(2, 5, device="cuda", dtype=torch.bool)
    assert check_flash_inputs(bf16, bf16, bf16, mask) == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16"):
        check_flash_inputs(bf16.half(), bf16.half(), bf16.half())
    fp32 = bf16.float()
    with pytest.raises(ValueError, match="autocast off"):
        check_flash_inputs(fp32, fp32, fp32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert check_flash_inputs(fp32, fp32, fp32, mask) == torch.bfloat16
    with pytest.raises(ValueError, match="attention_mask must be on"):
        check_flash_inputs(bf16, bf16, bf16, mask.cpu())
