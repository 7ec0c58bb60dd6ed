"""The memory options as one table: each option's flag and field, the step that applies it to the model, its terms
in the memory plan's estimate, its value for a model that does not train, why it keeps a step from being one CUDA
graph, the offer the memory plan makes with it, and its out-of-memory hint.

    >>> from playbook.memory import options
    >>> [o.flag for o in options.OPTIONS]
    ['--gradient-checkpointing', '--offload-activations', '--keep-attention', '--mlp-chunk-tokens', ...]

prepare_model's steps (model/models.py, `steps`), the estimate's inputs (plan/runs.py, `plan_terms`), the planner's
offers (plan/offers.py), the out-of-memory hints (plan/oom.py), a frozen model's options (distill.py's teacher,
plan/runs.py) and the CUDA-graph check (run/cuda_graph.py) iterate over OPTIONS, in its order, which is the order
their steps run and their lines print in. `values(cfg)` is the one place the fields are read from a RunConfig.

The mechanisms the entries switch (activations.py, saved_activations.py, tiled_mlp.py) take plain arguments, and
the estimate's arithmetic (plan/estimate.py) Setup fields named for what they do, not for an option. A new option
built from them is a field and its flag in config.py and an entry here; one that saves memory in a new way also
needs its mechanism and its bytes (a Setup field in plan/inputs.py, its arithmetic in plan/estimate.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from torch import nn

from core.process import log
from playbook.memory import activations, saved_activations, tiled_mlp
from playbook.runtime.common import usage_error
from playbook.sections import MemorySection, RunConfig

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


Step = Callable[[nn.Module, Sequence, dict], object]  # (model, its decoder layers, the fields' values)


@dataclass(frozen=True)
class MemoryOption:
    """One memory option: its flag and the RunConfig fields it sets (the first is its own).

    apply, stage  prepare_model's step with the option on, and when it runs: "layers" on Hugging Face's decoder
                  layers before peft wraps them, "finished" after LoRA (entries that share a step run it once)
    layer_kind, layer_spec  the kind of the decoder layers the SPEC of `layer_spec(values)` names, for the estimate
    plan          the estimate's Setup fields (plan/inputs.py) the option sets, from the fields' values
    """

    flag: str
    fields: tuple
    apply: Step | None = None
    stage: str = "finished"
    layer_kind: str | None = None
    layer_spec: Callable[[dict], str | None] = lambda v: None
    plan: Callable[[dict], dict] = lambda v: {}
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


# ------------------------------------------------------------------------------------------------
# prepare_model's steps (model/models.py runs them, in the table's order, at their stage)
# ------------------------------------------------------------------------------------------------
def apply_gradient_checkpointing(model: nn.Module, layers: Sequence[nn.Module], spec: str = "all",
                                 offload: bool = False, keep: bool = False) -> tuple[int, ...]:
    """--gradient-checkpointing / --checkpoint-layers SPEC: the decoder layers SPEC names are recomputed in
    backward, keeping only their inputs; --offload-activations (offload) keeps those in pinned host memory;
    --keep-attention (keep) also keeps attention's forward outputs, so the recompute skips attention.

    playbook/memory/activations.py: PyTorch's non-reentrant checkpoint, set per layer through the flag and function
    Hugging Face's decoder layers check; it needs no input that requires a gradient, so LoRA's frozen
    embeddings do not cut the adapters of checkpointed layers off from the loss. Returns the layers'
    indices; a SPEC naming a layer the model does not have is a usage error (exit code 2).
    """
    try:
        chosen = activations.apply_checkpointing(layers, spec, offload=offload, selective=keep)
    except ValueError as err:
        raise usage_error(f"--checkpoint-layers {err}") from None
    which = "each decoder layer" if len(chosen) == len(layers) else (
        f"{len(chosen)} of {len(layers)} decoder layers ({spec}: {', '.join(map(str, chosen))})")
    on_gpu = next(model.parameters()).device.type == "cuda"
    where = ("" if not offload else
             "; their inputs wait in pinned host memory (copied on a side stream, fetched back one layer ahead)"
             if on_gpu else "; --offload-activations copies their inputs to a second host buffer (on a CPU they "
             "are in host memory already: it saves nothing there, and runs the same code as on a GPU)")
    if keep:
        attn = getattr(model.config, "_attn_implementation", None)
        where += ("; attention's forward outputs kept, not recomputed" if attn == "sdpa" else
                  f"; --keep-attention keeps SDPA's outputs, and this model's attention is {attn!r}: "
                  "everything is recomputed")
    log(f"Gradient checkpointing: {which} recomputed in backward{where}")
    return chosen


def apply_tiled_mlp(model: nn.Module, layers: Sequence[nn.Module], chunk_tokens: int) -> int:
    """--mlp-chunk-tokens N: each decoder layer's MLP computed over chunks of N tokens, forward and backward,
    each chunk through the MLP's forward as the steps before left it (playbook/memory/tiled_mlp.py)."""
    mlps = tiled_mlp.apply_tiled_mlp(layers, chunk_tokens)
    width = getattr(model.config, "intermediate_size", None)
    log(f"Tiled MLP: {mlps} MLPs computed over chunks of {chunk_tokens:,} tokens"
        + (f" (one chunk's [{chunk_tokens:,}, {width:,}] intermediates at a time)" if width else ""))
    return mlps


def apply_saved_activations(model: nn.Module, layers: Sequence[nn.Module], norms: bool, offload_spec: str | None):
    """--recompute-norms (norms) / --offload-layers SPEC: what the layers that are not checkpointed save for
    backward, through saved-tensor hooks (playbook/memory/saved_activations.py): the norms' outputs recomputed from
    their inputs, and the named layers' saved tensors in pinned host memory. A layer both checkpointed and
    offloaded, or a SPEC naming a layer the model does not have, is a usage error (exit code 2)."""
    try:
        saved = saved_activations.apply_saved_activations(layers, norms, offload_spec)
    except ValueError as err:
        raise usage_error(f"--offload-layers {err}") from None
    parts = []
    if norms:
        parts.append("norm outputs recomputed in backward from their inputs")
    if offload_spec:
        chosen = activations.parse_layers(offload_spec, len(layers))
        parts.append(f"the saved tensors of {len(chosen)} of {len(layers)} decoder layers ({offload_spec}) wait in "
                     "pinned host memory (copied on a side stream, fetched back ahead of backward)")
    log("Saved activations: " + "; ".join(parts))
    return saved


def _saved_step(model: nn.Module, layers: Sequence[nn.Module], v: dict):  # one step for both of its options
    return apply_saved_activations(model, layers, v["recompute_norms"], v["offload_layers"])


def _checkpoint_spec(v: dict) -> str | None:
    return v["checkpoint_layers"] or ("all" if v["gradient_checkpointing"] else None)


OPTIONS = (
    MemoryOption(
        "--gradient-checkpointing", ("gradient_checkpointing", "checkpoint_layers"),
        apply=lambda model, layers, v: apply_gradient_checkpointing(
            model, layers, v["checkpoint_layers"] or "all", offload=v["offload_activations"],
            keep=v["keep_attention"]),
        stage="layers", layer_kind="checkpointed", layer_spec=_checkpoint_spec,
        frozen=dict(gradient_checkpointing=False, checkpoint_layers=None),
        offer=_checkpointing_offer,
        hint=lambda v, ctx: None if _checkpointed(v) else
        "--gradient-checkpointing (or --checkpoint-layers for some of the layers)"),
    MemoryOption(
        "--offload-activations", ("offload_activations",),  # (a part of the checkpointing step)
        plan=lambda v: dict(inputs_on_host=bool(v["offload_activations"])),
        graph_blocker="--offload-activations copies to host memory under the host's control",
        offer=_offload_activations_offer,
        hint=lambda v, ctx: "--offload-activations (the checkpointed layers' inputs wait in host memory)"
        if _checkpointed(v) and not v["offload_activations"] else None),
    MemoryOption(
        "--keep-attention", ("keep_attention",),  # (a part of the checkpointing step)
        plan=lambda v: dict(attention_kept=bool(v["keep_attention"])),
        offer=lambda v, ctx: Suggestion("no --keep-attention", drop=("--keep-attention",),
                                        changes=dict(keep_attention=False)) if v["keep_attention"] else None,
        hint=lambda v, ctx: "no --keep-attention (attention's outputs recomputed in backward instead of kept)"
        if v["keep_attention"] else None),
    MemoryOption(
        "--mlp-chunk-tokens", ("mlp_chunk_tokens",),
        apply=lambda model, layers, v: apply_tiled_mlp(model, layers, v["mlp_chunk_tokens"]),
        plan=lambda v: dict(mlp_chunk=int(v["mlp_chunk_tokens"] or 0)),
        offer=lambda v, ctx: Suggestion(f"--mlp-chunk-tokens {MLP_CHUNK_OFFER}",
                                        add=("--mlp-chunk-tokens", str(MLP_CHUNK_OFFER)),
                                        changes=dict(mlp_chunk_tokens=MLP_CHUNK_OFFER))
        if not v["mlp_chunk_tokens"] and ctx.tokens > MLP_CHUNK_OFFER else None,
        hint=lambda v, ctx: f"--mlp-chunk-tokens {MLP_CHUNK_OFFER} (the MLP's intermediates one chunk at a time)"
        if ctx.seq_len >= MLP_CHUNK_OFFER and not v["mlp_chunk_tokens"] else None),
    MemoryOption(
        "--recompute-norms", ("recompute_norms",), apply=_saved_step,
        plan=lambda v: dict(norms_recomputed=bool(v["recompute_norms"])), frozen=dict(recompute_norms=False),
        offer=lambda v, ctx: Suggestion("--recompute-norms", add=("--recompute-norms",),
                                        changes=dict(recompute_norms=True))
        if ctx.own_kernels and not v["recompute_norms"] and ctx.plain and not ctx.compile else None),
    MemoryOption(
        "--offload-layers", ("offload_layers",), apply=_saved_step,
        layer_kind="offloaded", layer_spec=lambda v: v["offload_layers"], frozen=dict(offload_layers=None),
        graph_blocker="--offload-layers copies to host memory under the host's control"),
)
BY_NAME = {o.name: o for o in OPTIONS}
FIELDS = tuple(f for o in OPTIONS for f in o.fields)
FROZEN = {k: v for o in OPTIONS for k, v in o.frozen.items()}  # a model that does not train: what serves backward off


def layer_spec(text: str) -> str:
    """argparse's type for a SPEC of decoder layers (activations.parse_layers): the SPEC, normalized."""
    try:
        activations.parse_layers(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip().lower()


# The options' flags as --help lists them: (flag, argparse's keywords); type "count" is the parser's own whole-number
# type (config/flags.py passes it), so its messages stay those of every other count.
ARGUMENTS = (
    ("--gradient-checkpointing", dict(action="store_true",
         help="recompute each decoder layer in backward (keeps only each layer's input; ~1/3 more "
              "compute); docs/memory.md")),
    ("--checkpoint-layers", dict(type=layer_spec, default=None, metavar="SPEC",
         help="checkpoint only these decoder layers: 'all', 'every:K' (layers 0, K, 2K, ...), 'first:N', "
              "or a comma list of layer indices (0-based); implies checkpointing")),
    ("--offload-activations", dict(action="store_true",
         help="with checkpointing: each checkpointed layer's input in pinned host memory instead of the "
              "GPU, copied on a side stream and fetched back one layer ahead in backward")),
    ("--keep-attention", dict(action="store_true",
         help="with checkpointing: keep attention's output and softmax statistics (2 bytes x hidden per "
              "token per layer) and recompute only the rest of each checkpointed layer; at long context "
              "attention is most of the recompute")),
    ("--recompute-norms", dict(action="store_true",
         help="layers not checkpointed keep each norm's input instead of its output (2 bytes x hidden x 2 "
              "per token per layer less) and run the norm again in backward; results unchanged")),
    ("--offload-layers", dict(type=layer_spec, default=None, metavar="SPEC",
         help="layers (not checkpointed) whose saved tensors wait in pinned host memory, copied on a side "
              "stream in forward and fetched back ahead of backward; same SPEC as --checkpoint-layers")),
    ("--mlp-chunk-tokens", dict(type="count", default=0, metavar="N",
         help="compute each MLP over chunks of N tokens, forward and backward, so that one chunk's "
              "[N, intermediate] tensors exist at a time; 0 = off")),
)


def add_flags(group, count) -> None:
    """Add the memory options' flags to an argparse group (make_parser's model options)."""
    for flag, keywords in ARGUMENTS:
        group.add_argument(flag, **(keywords | {"type": count} if keywords.get("type") == "count" else keywords))


def values(cfg: RunConfig) -> dict:
    """The memory options' fields of a RunConfig (or of its `as_dict()`, a saved summary's `config`), by name: the
    one place they are read from it."""
    given = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg.memory)
    return {name: given.get(name) for name in FIELDS}


def steps(v: dict, stage: str) -> list[Step]:
    """prepare_model's steps at `stage` ("layers" or "finished") for the options on, in the table's order, each
    once."""
    found = []
    for o in OPTIONS:
        if o.apply is not None and o.stage == stage and v[o.name] and o.apply not in found:
            found.append(o.apply)
    return found


def plan_terms(v: dict, layers: int) -> dict:
    """The estimate's Setup fields the options set (plan/inputs.py): each decoder layer's kind ("plain",
    "checkpointed", "offloaded": the first entry that names a layer gives it its kind) and every entry's `plan`."""
    kinds = ["plain"] * layers
    for o in OPTIONS:
        spec = o.layer_spec(v) if o.layer_kind else None
        try:
            chosen = activations.parse_layers(spec, layers) if spec else ()
        except ValueError:  # (the command line checked the SPEC against --num-layers, the model does later)
            chosen = ()
        for j in chosen:
            if kinds[j] == "plain":
                kinds[j] = o.layer_kind
    terms = dict(layer_kinds=tuple(kinds))
    for o in OPTIONS:
        terms.update(o.plan(v))
    return terms


def mlp_tiled(v: dict) -> bool:
    """Whether the MLP runs in chunks (the FP8 producers it may link depend on it: model/registry.py)."""
    return bool(v["mlp_chunk_tokens"])


def offers(v: dict, ctx: Context) -> list[Suggestion]:
    """The memory options' offers for a run (plan/offers.py plans each), in the table's order."""
    return [s for s in (o.offer(v, ctx) for o in OPTIONS) if s is not None]


def hints(v: dict, ctx: Context) -> list[str]:
    """The memory options' out-of-memory hints for a run (plan/oom.py), in the table's order."""
    return [h for h in (o.hint(v, ctx) for o in OPTIONS) if h is not None]


def graph_blocker(v: dict) -> str | None:
    """The first option on that keeps a step from being one CUDA graph (run/cuda_graph.py), or None."""
    return next((o.graph_blocker for o in OPTIONS if o.graph_blocker and v[o.name]), None)


def from_flags(a: argparse.Namespace) -> MemorySection:
    """The run's MemorySection from its parsed flags, the checkpointing and saved-activation options checked
    together (a usage error names the flags that do not go together)."""
    if a.gradient_checkpointing and a.checkpoint_layers not in (None, "all"):
        raise usage_error(f"--gradient-checkpointing checkpoints every layer, --checkpoint-layers {a.checkpoint_layers} "
                          "only some: give one of them")
    if a.offload_activations and not (a.gradient_checkpointing or a.checkpoint_layers):
        raise usage_error("--offload-activations moves the inputs of checkpointed layers to host memory: it needs "
                          "--gradient-checkpointing or --checkpoint-layers")
    if a.keep_attention and not (a.gradient_checkpointing or a.checkpoint_layers):
        raise usage_error("--keep-attention keeps attention's outputs in checkpointed layers: it needs "
                          "--gradient-checkpointing or --checkpoint-layers")
    if (a.recompute_norms or a.offload_layers) and a.compile:
        raise usage_error("--recompute-norms and --offload-layers act through saved-tensor hooks, which run eagerly: "
                          "not with --compile")
    if a.gradient_checkpointing and a.offload_layers:
        raise usage_error("--gradient-checkpointing checkpoints every layer and --offload-layers offloads layers that "
                          "are not checkpointed: name the checkpointed ones with --checkpoint-layers")
    for flag, spec in (("--checkpoint-layers", a.checkpoint_layers), ("--offload-layers", a.offload_layers)):
        if spec and a.num_layers:
            try:
                activations.parse_layers(spec, a.num_layers)
            except ValueError as err:
                raise usage_error(f"{flag} {err} (--num-layers {a.num_layers})") from None
    checkpoint_layers = a.checkpoint_layers or ("all" if a.gradient_checkpointing else None)
    return MemorySection(
        gradient_checkpointing=checkpoint_layers is not None, checkpoint_layers=checkpoint_layers,
        offload_activations=a.offload_activations, keep_attention=a.keep_attention,
        recompute_norms=a.recompute_norms, offload_layers=a.offload_layers, mlp_chunk_tokens=a.mlp_chunk_tokens)
