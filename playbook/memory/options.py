"""The memory options as one table: each option's flag and field, its value for a model that does not train, why it
keeps a step from being one CUDA graph, the offer the memory plan makes with it, and its out-of-memory hint.

    >>> from playbook.memory import options
    >>> [o.flag for o in options.OPTIONS]
    ['--gradient-checkpointing', '--offload-activations', '--keep-attention', '--mlp-chunk-tokens', ...]

The planner's offers (plan/offers.py), the out-of-memory hints (plan/oom.py), a frozen model's options (distill.py's
teacher, plan/runs.py) and the CUDA-graph check (run/cuda_graph.py) iterate over OPTIONS, in its order, which is
the order their lines print in. `values(cfg)` is the one place the fields are read from a RunConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

MLP_CHUNK_OFFER = 16384  # the --mlp-chunk-tokens the plan offers and the hints name, above that many tokens


class Context(NamedTuple):
    """What an option's offer and hint read besides the memory fields: the run's other facts."""

    on_gpu: bool
    compile: bool = False
    seq_len: int = 0
    tokens: int = 0  # per micro-batch
    plain: bool = True  # some decoder layer is neither checkpointed nor offloaded
    own_kernels: bool = False  # this project's layer kernels (the plan's kernel kind "playbook")


class Suggestion(NamedTuple):
    """An offer of the memory plan (plan/offers.Offer takes these fields): its text, the command-line words it
    adds, the flags it drops, and the fields it changes."""

    text: str
    add: tuple = ()
    drop: tuple = ()
    changes: dict = {}


@dataclass(frozen=True)
class MemoryOption:
    """One memory option: its flag and the RunConfig fields it sets (the first is its own)."""

    flag: str
    fields: tuple
    frozen: dict = field(default_factory=dict)  # the fields' values for a model that does not train (none: kept)
    graph_blocker: str | None = None  # why a step with it on cannot be one CUDA graph (a short clause)
    offer: Callable[[dict, Context], Suggestion | None] = lambda v, ctx: None
    hint: Callable[[dict, Context], str | None] = lambda v, ctx: None

    @property
    def name(self) -> str:
        return self.fields[0]


def _checkpointed(v: dict) -> bool:
    return bool(v["gradient_checkpointing"] or v["checkpoint_layers"])


def _checkpointing_offer(v: dict, ctx: Context) -> Suggestion | None:
    if not ctx.plain or v["offload_layers"]:  # (--gradient-checkpointing with --offload-layers is refused)
        return None
    changes = dict(gradient_checkpointing=True, checkpoint_layers="all")
    if v["checkpoint_layers"] is None:
        return Suggestion("--gradient-checkpointing", add=("--gradient-checkpointing",), changes=changes)
    return Suggestion(f"--gradient-checkpointing instead of --checkpoint-layers {v['checkpoint_layers']}",
                      add=("--gradient-checkpointing",), drop=("--checkpoint-layers",), changes=changes)


def _offload_activations_offer(v: dict, ctx: Context) -> Suggestion | None:
    if (ctx.plain and not v["offload_layers"]) or not v["checkpoint_layers"] or v["offload_activations"]:
        return None  # (offered where checkpointing is not, and on a CPU the host holds both)
    if not ctx.on_gpu:
        return None
    return Suggestion("--offload-activations", add=("--offload-activations",), changes=dict(offload_activations=True))


OPTIONS = (
    MemoryOption(
        "--gradient-checkpointing", ("gradient_checkpointing", "checkpoint_layers"),
        frozen=dict(gradient_checkpointing=False, checkpoint_layers=None),
        offer=_checkpointing_offer,
        hint=lambda v, ctx: None if _checkpointed(v) else
        "--gradient-checkpointing (or --checkpoint-layers for some of the layers)"),
    MemoryOption(
        "--offload-activations", ("offload_activations",),
        graph_blocker="--offload-activations copies to host memory under the host's control",
        offer=_offload_activations_offer,
        hint=lambda v, ctx: "--offload-activations (the checkpointed layers' inputs wait in host memory)"
        if _checkpointed(v) and not v["offload_activations"] else None),
    MemoryOption(
        "--keep-attention", ("keep_attention",),
        offer=lambda v, ctx: Suggestion("no --keep-attention", drop=("--keep-attention",),
                                        changes=dict(keep_attention=False)) if v["keep_attention"] else None,
        hint=lambda v, ctx: "no --keep-attention (attention's outputs recomputed in backward instead of kept)"
        if v["keep_attention"] else None),
    MemoryOption(
        "--mlp-chunk-tokens", ("mlp_chunk_tokens",),
        offer=lambda v, ctx: Suggestion(f"--mlp-chunk-tokens {MLP_CHUNK_OFFER}",
                                        add=("--mlp-chunk-tokens", str(MLP_CHUNK_OFFER)),
                                        changes=dict(mlp_chunk_tokens=MLP_CHUNK_OFFER))
        if not v["mlp_chunk_tokens"] and ctx.tokens > MLP_CHUNK_OFFER else None,
        hint=lambda v, ctx: f"--mlp-chunk-tokens {MLP_CHUNK_OFFER} (the MLP's intermediates one chunk at a time)"
        if ctx.seq_len >= MLP_CHUNK_OFFER and not v["mlp_chunk_tokens"] else None),
    MemoryOption(
        "--recompute-norms", ("recompute_norms",), frozen=dict(recompute_norms=False),
        offer=lambda v, ctx: Suggestion("--recompute-norms", add=("--recompute-norms",),
                                        changes=dict(recompute_norms=True))
        if ctx.own_kernels and not v["recompute_norms"] and ctx.plain and not ctx.compile else None),
    MemoryOption(
        "--offload-layers", ("offload_layers",), frozen=dict(offload_layers=None),
        graph_blocker="--offload-layers copies to host memory under the host's control"),
)
BY_NAME = {o.name: o for o in OPTIONS}
FIELDS = tuple(f for o in OPTIONS for f in o.fields)
FROZEN = {k: v for o in OPTIONS for k, v in o.frozen.items()}  # a model that does not train: what serves backward off


def values(cfg) -> dict:
    """The memory options' fields of a RunConfig (or of its `as_dict()`, a saved summary's `config`), by name: the
    one place they are read from it."""
    given = cfg if isinstance(cfg, dict) else cfg.as_dict()
    return {name: given.get(name) for name in FIELDS}




def offers(v: dict, ctx: Context) -> list[Suggestion]:
    """The memory options' offers for a run (plan/offers.py plans each), in the table's order."""
    return [s for s in (o.offer(v, ctx) for o in OPTIONS) if s is not None]


def hints(v: dict, ctx: Context) -> list[str]:
    """The memory options' out-of-memory hints for a run (plan/oom.py), in the table's order."""
    return [h for h in (o.hint(v, ctx) for o in OPTIONS) if h is not None]


def graph_blocker(v: dict) -> str | None:
    """The first option on that keeps a step from being one CUDA graph (run/cuda_graph.py), or None."""
    return next((o.graph_blocker for o in OPTIONS if o.graph_blocker and v[o.name]), None)
