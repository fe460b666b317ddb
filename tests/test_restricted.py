"""``core.memory_model.restricted``: one profile with every long-context option (chunk_loss, tile_mlp, offload),
solved without one of them, plans as a profile made without that option does (benchmarks/long_context_table.py
re-solves one 8B profile this way instead of profiling it once per option, minutes each)."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_remat import profile_step, solve
from lightning_remat.core.config import ProfileOptions
from lightning_remat.core.memory_model import restricted
from lightning_remat.core.offload_model import to_host

transformers.logging.set_verbosity_error()
VOCAB = 512
WITHOUT = {"offload": lambda o: not to_host(o),
           "tile_mlp": lambda o: "tile:" not in o.name,
           "chunk_loss": lambda o: o.action.chunks is None}


def _profile(**options):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB, use_cache=False)
    ids = torch.randint(0, VOCAB, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    return profile_step(model, lambda m: m(input_ids=ids, labels=ids).loss,
                        optimizer=torch.optim.AdamW(model.parameters()),
                        options=ProfileOptions(fake=True, device="cuda", gpu="h100", precision="bf16-true", **options))


ALL = dict(chunk_loss=True, tile_mlp=True, offload=True)


@pytest.fixture(scope="module")
def every_option():
    return _profile(**ALL)


@pytest.mark.parametrize("option", list(WITHOUT))
def test_a_profile_solved_without_an_option_plans_as_one_made_without_it(every_option, option):
    names = {o.name for s in every_option.stages for o in s.options}
    offered = {o.name for s in restricted(every_option, WITHOUT[option]).stages for o in s.options}
    assert offered < names and "keep" in offered  # something withdrawn, every stage keeps "keep"
    without = _profile(**{**ALL, option: False})
    assert offered == {o.name for s in without.stages for o in s.options}
    least = solve(restricted(every_option, WITHOUT[option]), "min", cost="flops")
    assert least.predicted_peak_bytes == solve(without, "min", cost="flops").predicted_peak_bytes
    assert least.predicted_peak_bytes > solve(every_option, "min", cost="flops").predicted_peak_bytes
