"""Model sizes of the example. Tiny on purpose: the demo trains on two CPU cores."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TargetConfig:
    """The frozen target transformer whose per-token outputs are cached."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_size: int = 128
    seed: int = 1234
    #: Scales the output logits; > 1 sharpens the target distribution so the top-k
    #: carries most of the probability mass (a more informative distillation target).
    logit_scale: float = 3.0


@dataclass(frozen=True)
class StudentConfig:
    """The MoE student trained with EP + CP on the cached supervision."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 4
    router_topk: int = 2
    expert_ffn_size: int = 64
    target_hidden_size: int = 64
    seed: int = 42
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}; "
                "pick sizes with hidden_size % num_heads == 0"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} must be even for rotary embeddings; "
                "change hidden_size or num_heads"
            )
        if not 1 <= self.router_topk <= self.num_experts:
            raise ValueError(
                f"router_topk={self.router_topk} must be in [1, num_experts={self.num_experts}]"
            )


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict of a config dataclass (recorded in the manifest / checkpoints)."""
    return asdict(cfg)


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a config dataclass, ignoring keys it does not know."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})
