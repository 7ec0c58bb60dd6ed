"""The memory plan's inputs and result: the numbers of a model that decide its memory (Shape), the options of a
run that do (Setup), and what the estimate finds (Plan; playbook/plan/estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.fp8_support import FP8_MIN_WIDTH, bf16_layer_counts

GB = 1e9  # the scripts' summaries count GB as 10^9 bytes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """The numbers of a LLaMA-family config that decide its memory."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    positions: int | None = None  # the positions it was trained on (max_position_embeddings); None: not known

    @classmethod
    def from_config(cls, config, num_layers: int | None = None) -> "Shape":
        """From a Hugging Face config (an object or its dict); `num_layers` keeps the first N layers."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        layers = int(get("num_hidden_layers"))
        return cls(vocab=int(get("vocab_size")), hidden=hidden, intermediate=int(get("intermediate_size")),
                   layers=min(num_layers, layers) if num_layers else layers, heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or hidden // heads), tied=bool(get("tie_word_embeddings", False)),
                   positions=int(get("max_position_embeddings") or 0) or None)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def projection_sizes(self) -> dict:
        """(in, out) of each of a layer's seven projections."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def projection_params(self) -> int:  # per layer
        return sum(a * b for a, b in self.projection_sizes().values())

    @property
    def params(self) -> int:
        layer = self.projection_params + 2 * self.hidden  # and the two norms
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def lora_params(self, r: int, targets) -> int:
        return self.layers * sum(r * (a + b) for name, (a, b) in self.projection_sizes().items() if name in targets)

    def fp8_groups(self, rule: str) -> list:
        """(in, out) of the matmuls per layer that FP8 converts: with rule 'auto', the groups that share an
        input (q/k/v, gate/up) and the others of harmonic width in x out / (in + out) >= FP8_MIN_WIDTH."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        groups = ((h, q + 2 * kv), (q, h), (h, 2 * i), (i, h))
        return [(a, b) for a, b in groups if rule == "all" or a * b / (a + b) >= FP8_MIN_WIDTH]

    def fp8_params(self, rule: str) -> int:
        """Projection weights per layer that FP8 converts (`fp8_groups`)."""
        return sum(a * b for a, b in self.fp8_groups(rule))


@dataclass(frozen=True)
class Setup:
    """The options of a run that decide its memory (`setup_from`: from a RunConfig or a saved summary)."""

    batch: int
    seq: int
    grad_accum: int = 1
    lora_r: int = 0
    lora_targets: tuple = PROJECTIONS
    load_in_4bit: bool = False
    fp8: bool = False
    fp8_rule: str = "auto"  # --fp8-layers
    fp8_recipe: str = "rowwise"  # --fp8-recipe as the run names it ("nvfp4-emulated" under --fp8-emulate)
    # the memory options' terms (memory/options.py's `plan_terms`):
    layer_kinds: tuple = ()  # per decoder layer: "plain", "checkpointed" or "offloaded" (--offload-layers)
    inputs_on_host: bool = False  # the checkpointed layers' inputs wait in host memory (--offload-activations)
    attention_kept: bool = False  # checkpointed layers keep attention's output and statistics (--keep-attention)
    norms_recomputed: bool = False  # plain layers keep the norms' inputs, not their outputs (--recompute-norms)
    mlp_chunk: int = 0  # the MLP computed over chunks of this many tokens; 0: in one piece (--mlp-chunk-tokens)
    optimizer: str = "adamw-fused"
    rounding: str = "nearest"  # "nearest", "stochastic", "kahan" or "fp32-master"
    in_backward: bool = False
    kernels: str = "playbook"  # "playbook" (this project's kernels), "liger" (a peer's), "hf" (none)
    loss: str = "fused"  # "fused" (linear cross-entropy), "chunked" (cross-entropy kernel), "full" (fp32 logits)
    world: int = 1
    weight_bytes: int = 2  # bf16; 4 where a CPU trains in fp32
    trains: bool = True
    partial_kernels: bool = False  # a kernel set between none and the default one: estimated from the nearest

    @property
    def tokens(self) -> int:  # per micro-batch
        return self.batch * self.seq

    def fp8_layers(self, layers: int) -> int:
        """How many of the model's decoder layers run FP8 (the recipe keeps some at the ends in bf16)."""
        return max(0, layers - sum(bf16_layer_counts(self.fp8_recipe, layers))) if self.fp8 else 0


@dataclass
class Plan:
    """What `estimate` found: the parts in bytes, the peak, where it comes, and notes on the approximations."""

    parts: dict  # name -> (bytes, what)
    peak: float
    where: str
    notes: list = field(default_factory=list)
