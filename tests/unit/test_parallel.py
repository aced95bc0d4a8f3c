"""The divisibility preflight: which tensor/expert-parallel sizes a model splits into."""

from __future__ import annotations

from atlas.domain.models.config import ModelConfig
from atlas.domain.parallel import (
    ShardedSizes,
    fitting_expert_parallel_sizes,
    fitting_tensor_parallel_sizes,
    parallel_refusal,
)

LLAMA_8B = ShardedSizes(num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256)
SMOLLM2_135M = ShardedSizes(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
MIXTRAL = ShardedSizes(32, 8, 14336, 32000, num_experts=8, expert_intermediate_size=14336)


def test_the_8b_splits_over_powers_of_two_and_refuses_three_naming_what_breaks():
    assert [size for size in (1, 2, 4, 8) if parallel_refusal(LLAMA_8B, size) is None] == [1, 2, 4, 8]
    message = parallel_refusal(LLAMA_8B, 3)
    assert message == (
        "tensor-parallel size 3 does not divide this model: 32 attention heads do not split into 3; "
        "8 KV heads neither split into 3 nor replicate evenly onto 3 ranks; "
        "feed-forward width 14336 does not split into 3. Tensor-parallel sizes that fit (up to 8): 1, 2, 4, 8"
    )


def test_the_vocabulary_is_named_when_only_it_does_not_split():
    sizes = ShardedSizes(num_heads=8, num_kv_heads=8, intermediate_size=1024, vocab_size=32001)
    assert parallel_refusal(sizes, 2) == (
        "tensor-parallel size 2 does not divide this model: vocabulary of 32001 does not split into 2. "
        "Tensor-parallel sizes that fit (up to 8): 1"
    )


def test_fewer_kv_heads_than_ranks_replicate_when_the_ranks_are_a_multiple():
    sizes = ShardedSizes(num_heads=16, num_kv_heads=2, intermediate_size=4096, vocab_size=32768)
    assert parallel_refusal(sizes, 4) is None  # each KV head on 2 ranks
    assert parallel_refusal(sizes, 8) is None
    assert fitting_tensor_parallel_sizes(sizes, 16) == [1, 2, 4, 8, 16]
    assert "2 KV heads neither split into 3" in parallel_refusal(sizes, 3)


def test_a_model_with_nine_heads_fits_three_ranks_but_not_two():
    assert fitting_tensor_parallel_sizes(SMOLLM2_135M, 8) == [1, 3]
    assert parallel_refusal(SMOLLM2_135M, 3) is None
    assert parallel_refusal(SMOLLM2_135M, 2).endswith("Tensor-parallel sizes that fit (up to 8): 1, 3")


def test_experts_split_over_expert_parallel_ranks_that_divide_the_tensor_parallel_ones():
    assert parallel_refusal(MIXTRAL, 8, expert_parallel=8) is None
    assert parallel_refusal(MIXTRAL, 8, expert_parallel=2) is None  # 4 ranks share each expert
    assert fitting_expert_parallel_sizes(MIXTRAL, 8) == [1, 2, 4, 8]
    assert parallel_refusal(MIXTRAL, 4, expert_parallel=3) == (
        "expert-parallel size 3 does not fit this model at tensor-parallel size 4: "
        "3 does not divide the tensor-parallel size 4. Expert-parallel sizes that fit: 1, 2, 4"
    )
    sizes = ShardedSizes(16, 16, 4096, 32768, num_experts=6, expert_intermediate_size=1408)
    assert parallel_refusal(sizes, 4, expert_parallel=4) == (
        "expert-parallel size 4 does not fit this model at tensor-parallel size 4: "
        "6 experts do not split into 4. Expert-parallel sizes that fit: 1, 2"
    )


def test_an_expert_width_that_no_expert_size_fixes_points_back_to_the_tensor_size():
    sizes = ShardedSizes(8, 8, 4096, 32768, num_experts=3, expert_intermediate_size=1002)
    assert fitting_expert_parallel_sizes(sizes, 8) == []
    message = parallel_refusal(sizes, 8)
    assert "expert width 1002 does not split over the 8 ranks that share each expert" in message
    assert message.endswith("Tensor-parallel sizes that fit (up to 8): 1, 2")


def test_expert_parallelism_needs_experts_and_sizes_start_at_one():
    assert "the model has no experts" in parallel_refusal(LLAMA_8B, 2, expert_parallel=2)
    assert parallel_refusal(LLAMA_8B, 0) == "parallel sizes must be at least 1 (tensor-parallel 0, expert-parallel 1)"


def test_sizes_are_read_from_a_config_including_its_experts():
    base = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "num_hidden_layers": 2, "vocab_size": 32000,
    }
    assert ShardedSizes.of(ModelConfig.from_dict({**base, "num_local_experts": 8})) == MIXTRAL
    qwen = ShardedSizes.of(ModelConfig.from_dict({**base, "num_experts": 128, "moe_intermediate_size": 768}))
    assert (qwen.num_experts, qwen.expert_intermediate_size) == (128, 768)
    dense = ShardedSizes.of(ModelConfig.from_dict(base))
    assert (dense.num_experts, dense.expert_intermediate_size, dense.num_kv_heads) == (0, 0, 8)
