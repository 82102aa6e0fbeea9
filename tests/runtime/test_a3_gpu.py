"""A3 fused prefill in the CUDA runtime (paged decode, CUDA graphs) against the CPU reference path."""
import pytest
import torch

from macattn.methods.mac.config import MacConfig

from _tiny import tiny_model
from macattn.methods.a3.config import A3Config
from macattn.runtime import ModelRunner
from macattn.runtime.a3_assembly import RagPrompt, fused_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rho", [1.0, 0.3])
def test_cuda_runner_documents_match_reference(family, rho, tmp_path):
    g = torch.Generator().manual_seed(11)
    r = lambda n: torch.randint(0, 256, (n,), generator=g)   # noqa: E731
    systems, docs, questions = [r(6), r(3)], [[r(9), r(12), r(5)], [r(20)]], [r(5), r(7)]
    cfg = A3Config(rho=rho, method="a3", store_dir=str(tmp_path))
    # fp32 on both sides, MAC off (decode = exact attention through the paged Triton plan)
    runner = ModelRunner.from_hf(tiny_model(family).float(), MacConfig(enabled=False), device="cuda",
                                 max_batch_size=4, max_seq_len=128, num_blocks=64, block_size=8)
    out = runner.generate(systems, documents=docs, question_ids=questions, max_new_tokens=6, a3=cfg,
                          return_dict=True, output_sequence_lengths=True)
    for b in range(2):
        ref, _ = fused_generate(tiny_model(family).float(), RagPrompt(systems[b], docs[b], questions[b]), cfg, max_new_tokens=6)
        L = int(out["sequence_lengths"][b, 0])
        assert out["output_ids"][b, 0, L - 6:L].tolist() == ref
