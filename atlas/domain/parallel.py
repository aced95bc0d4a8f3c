"""Whether a model splits over N ranks: the divisibility check made before anything loads.

Tensor parallelism over `t` ranks gives each rank 1/t of every attention head group, of the
feed-forward width and of the vocabulary (embedding rows and LM-head columns); expert
parallelism over `e` ranks gives each rank 1/e of the experts, each expert's width then split
over the t/e ranks that share them:

    attention heads      num_heads % t == 0
    KV heads             num_kv_heads % t == 0, or t % num_kv_heads == 0 (each KV head is then
                         replicated on t / num_kv_heads ranks, next to its query heads)
    feed-forward width   intermediate_size % t == 0
    vocabulary           vocab_size % t == 0
    experts              t % e == 0, num_experts % e == 0, expert width % (t / e) == 0
    linear attention     key heads % t == 0 and value heads % t == 0 (Gated DeltaNet)

(e = 1 puts every expert on all t ranks; e = t gives each rank whole experts.) A size that
breaks one of these is refused at start with the sizes that would work. `RankPlacement` says
which part of each of these one rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas.domain.models.config import ModelConfig

# config.json keys of the expert count and an expert's width, by family (Mixtral; Qwen-MoE,
# DeepSeek). A Mixtral expert is `intermediate_size` wide.
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_EXPERT_WIDTH_KEY = "moe_intermediate_size"
_LINEAR_HEAD_KEYS = ("linear_num_key_heads", "linear_num_value_heads")  # Qwen3-Next


@dataclass(frozen=True, slots=True)
class ShardedSizes:
    """The dimensions of a model that parallelism splits."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0  # 0: a dense model
    expert_intermediate_size: int = 0
    linear_key_heads: int = 0  # Gated DeltaNet layers' heads (0: none)
    linear_value_heads: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> ShardedSizes:
        num_experts = next((int(config.raw[key]) for key in _EXPERT_COUNT_KEYS if config.raw.get(key)), 0)
        expert_width = int(config.raw.get(_EXPERT_WIDTH_KEY) or config.intermediate_size) if num_experts else 0
        return cls(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_experts=num_experts,
            expert_intermediate_size=expert_width,
            linear_key_heads=int(config.raw.get(_LINEAR_HEAD_KEYS[0]) or 0),
            linear_value_heads=int(config.raw.get(_LINEAR_HEAD_KEYS[1]) or 0),
        )


def parallel_refusal(
    sizes: ShardedSizes, tensor_parallel: int, expert_parallel: int = 1, max_ranks: int = 8
) -> str | None:
    """Why the model cannot run with these sizes, naming the sizes that would work (at most
    `max_ranks` ranks, e.g. the GPUs of the host); None when it can. The message names the
    sizes, not the flags: the caller adds the flag it read them from."""
    if tensor_parallel < 1 or expert_parallel < 1:
        return f"parallel sizes must be at least 1 (tensor-parallel {tensor_parallel}, expert-parallel {expert_parallel})"
    problems = _tensor_problems(sizes, tensor_parallel)
    if problems:
        fitting = ", ".join(map(str, fitting_tensor_parallel_sizes(sizes, max_ranks)))
        return (
            f"tensor-parallel size {tensor_parallel} does not divide this model: {'; '.join(problems)}. "
            f"Tensor-parallel sizes that fit (up to {max_ranks}): {fitting}"
        )
    problems = _expert_problems(sizes, tensor_parallel, expert_parallel)
    if problems:
        fitting = fitting_expert_parallel_sizes(sizes, tensor_parallel)
        advice = (
            f"Expert-parallel sizes that fit: {', '.join(map(str, fitting))}"
            if fitting
            else f"Tensor-parallel sizes that fit (up to {max_ranks}): "
            f"{', '.join(map(str, fitting_tensor_parallel_sizes(sizes, max_ranks)))}"
        )
        return (
            f"expert-parallel size {expert_parallel} does not fit this model at tensor-parallel size "
            f"{tensor_parallel}: {'; '.join(problems)}. {advice}"
        )
    return None


def fitting_tensor_parallel_sizes(sizes: ShardedSizes, max_ranks: int) -> list[int]:
    """Every tensor-parallel size up to `max_ranks` the model divides by, with some
    expert-parallel size for a mixture of experts."""
    return [
        size
        for size in range(1, max_ranks + 1)
        if not _tensor_problems(sizes, size) and (not sizes.num_experts or fitting_expert_parallel_sizes(sizes, size))
    ]


def fitting_expert_parallel_sizes(sizes: ShardedSizes, tensor_parallel: int) -> list[int]:
    """Every expert-parallel size that fits at `tensor_parallel` (empty for a dense model)."""
    if not sizes.num_experts:
        return []
    return [size for size in range(1, tensor_parallel + 1) if not _expert_problems(sizes, tensor_parallel, size)]


def _tensor_problems(sizes: ShardedSizes, ranks: int) -> list[str]:
    problems = []
    if sizes.num_heads % ranks:
        problems.append(f"{sizes.num_heads} attention heads do not split into {ranks}")
    if sizes.num_kv_heads % ranks and ranks % sizes.num_kv_heads:
        problems.append(
            f"{sizes.num_kv_heads} KV heads neither split into {ranks} nor replicate evenly onto {ranks} ranks"
        )
    if sizes.intermediate_size % ranks:
        problems.append(f"feed-forward width {sizes.intermediate_size} does not split into {ranks}")
    if sizes.vocab_size % ranks:
        problems.append(f"vocabulary of {sizes.vocab_size} does not split into {ranks}")
    for name, heads in (("linear-attention key", sizes.linear_key_heads),
                        ("linear-attention value", sizes.linear_value_heads)):
        if heads % ranks:
            problems.append(f"{heads} {name} heads do not split into {ranks}")
    return problems


def _expert_problems(sizes: ShardedSizes, tensor_parallel: int, expert_parallel: int) -> list[str]:
    if not sizes.num_experts:
        return [] if expert_parallel == 1 else ["the model has no experts"]
    if tensor_parallel % expert_parallel:
        return [f"{expert_parallel} does not divide the tensor-parallel size {tensor_parallel}"]
    problems = []
    if sizes.num_experts % expert_parallel:
        problems.append(f"{sizes.num_experts} experts do not split into {expert_parallel}")
    ranks_per_expert = tensor_parallel // expert_parallel
    if sizes.expert_intermediate_size % ranks_per_expert:
        problems.append(
            f"expert width {sizes.expert_intermediate_size} does not split over the {ranks_per_expert} ranks "
            f"that share each expert"
        )
    return problems


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """What rank `rank` of `tensor_parallel` ranks holds, `expert_parallel` of them splitting
    the experts (sizes already checked by `parallel_refusal`).

    Every split is contiguous and in rank order. Experts go to groups of t / e consecutive
    ranks; within a group each rank holds 1/(t / e) of each of its experts' width:

        t = 4, e = 2, 8 experts:   rank      0      1      2      3
                                   experts   0..3   0..3   4..7   4..7
                                   width     1st    2nd    1st    2nd half
    """

    rank: int
    tensor_parallel: int
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tensor_parallel or self.tensor_parallel % self.expert_parallel:
            raise ValueError(f"rank {self.rank} of {self.tensor_parallel} with expert-parallel {self.expert_parallel}")

    @property
    def carries_residual(self) -> bool:
        """Whether this rank's partial sums include the residual stream (rank 0's do; the
        others' start from zero, so one all-reduce adds every part to it once)."""
        return self.rank == 0

    def split(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's 1/t of `total` items (heads, columns, vocabulary rows)."""
        return _part(total, self.rank, self.tensor_parallel)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank holds: its 1/t, or, with fewer KV heads than ranks, the one
        head its query heads read (each KV head then replicated on t / num_kv_heads ranks)."""
        if num_kv_heads % self.tensor_parallel == 0:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.tensor_parallel
        return head, head + 1

    def experts(self, num_experts: int) -> tuple[int, int]:
        """[first, stop) of the experts this rank holds (all of them without expert parallelism)."""
        ranks_per_group = self.tensor_parallel // self.expert_parallel
        return _part(num_experts, self.rank // ranks_per_group, self.expert_parallel)

    def expert_width(self, width: int) -> tuple[int, int]:
        """[start, stop) of each held expert's intermediate width that this rank computes."""
        ranks_per_group = self.tensor_parallel // self.expert_parallel
        return _part(width, self.rank % ranks_per_group, ranks_per_group)


def _part(total: int, index: int, count: int) -> tuple[int, int]:
    if total % count:
        raise ValueError(f"{total} does not split into {count} equal parts")
    size = total // count
    return index * size, (index + 1) * size
