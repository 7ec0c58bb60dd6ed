"""What an FP8 recipe can run on which device: the recipes, the per-GPU gates and the checks run once per GPU.

The FP8 lessons (fp8_linear_kernel.py, fp8_recipes_kernel.py) run their recipes; this module says, without
launching a kernel of theirs, which recipes a device can run:

    RECIPES, get_recipe       the recipes by name (`--fp8-recipe`): which scales, which matmuls stay bf16
    unsupported_reason        why a projection's shape cannot go through a recipe's scaled matmul
    expected_patches          how many decoder projections a recipe converts, from a model's config
    size_reason               why a projection is too small for FP8 to gain on a GPU (the size rule)
    check_device              refuse, in one line, a device that cannot run a recipe; run the recipe's
                              probe (given by the lesson: its quantizers and matmuls on tiny tensors) once
                              per GPU, PyTorch, Triton and scaling
    fast_accum_allowed        whether the forward matmul may use fast accumulation on this GPU family
    compiled_graph_trusted    whether torch.compile may trace an FP8 layer into its graph on this device
    Fp8KernelMismatch         what a probe raises when a quantizer writes other bytes than its reference

Every gate decides by GPU family (`gpu_arch`), never by a literal compute capability.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

import torch

from core import gpu_arch

ALIGN = 16  # torch._scaled_mm: reduced dimensions and b's columns must be multiples of 16
MAX_COLS = 65536  # one row must fit in one program's registers (the quantizing kernels hold a whole row)


@dataclass(frozen=True)
class Fp8Recipe:
    """Which scales the FP8 layers use, and which matmuls stay in bf16 (`--fp8-recipe NAME`).

    scaling          "row": one fp32 scale per row (or column) of each operand, along the reduction;
                     "tensor": one fp32 scale per tensor; "block": 1x128 blocks of activations and
                     gradients, 128x128 tiles of weights (DeepSeek-V3); "mx": 1x32 blocks with
                     power-of-two (e8m0) scales, OCP's MXFP8, Blackwell's native format; "nvfp4":
                     e2m1 values in 1x16 blocks with e4m3 scales and an fp32 tensor scale, 16x16 blocks
                     for weights, stochastic rounding of gradients and a random Hadamard transform of
                     the dW operands (NVIDIA's NVFP4 training recipe; mx_quant_kernel.py).
    bf16_dgrad       the input-gradient matmul dx = dy W runs in bf16 (forward and dW in FP8)
    bf16_end_layers  the first and the last N decoder layers keep nn.Linear projections
    bf16_last_layers the last N decoder layers keep nn.Linear projections, at most an eighth of the
                     model's layers (NVFP4: NVIDIA's recipe keeps the last 4 of LLaMA 3.1 8B's 32 in bf16;
                     SmolLM2-135M keeps 3 of 30, a 2-layer test model none; the lm_head is never converted)
    four_over_six    NVFP4 with Four Over Six block scales (Cook et al., 2025): each 1x16 block of weights
                     and activations maps its maximum to 6 or to 4, whichever leaves the smaller squared
                     error; weights in 1x16 blocks (not 16x16 tiles); gradients as in "nvfp4"
    emulated         the block-scaled formats on a GPU without block-scaled tensor cores (Hopper) or
                     the CPU: the same quantization, the matmuls from the dequantized operands in bf16;
                     accuracy only, never a speed (`--fp8-emulate`)
    align            in_features and out_features must be multiples of it: torch._scaled_mm's 16;
                     whole blocks; for 128x128 tiles groups of 4 blocks, because cuBLAS reads tile
                     scales with a leading dimension rounded up to 4 (PyTorch's block-wise path
                     passes the unrounded one, so other widths would compute silently wrong results)
    """

    name: str
    scaling: str
    bf16_dgrad: bool = False
    bf16_end_layers: int = 0
    block: int = 0  # the block length along the reduction ("block": 128, "mx": 32, "nvfp4": 16)
    align: int = 16
    bf16_last_layers: int = 0
    four_over_six: bool = False
    emulated: bool = False


RECIPES = {r.name: r for r in (
    Fp8Recipe("rowwise", "row"),
    Fp8Recipe("rowwise-bf16-dgrad", "row", bf16_dgrad=True),
    Fp8Recipe("rowwise-bf16-ends", "row", bf16_end_layers=2),
    Fp8Recipe("tensorwise", "tensor"),
    Fp8Recipe("blockwise", "block", block=128, align=4 * 128),
    Fp8Recipe("mxfp8", "mx", block=32, align=32),
    Fp8Recipe("nvfp4", "nvfp4", block=16, align=32, bf16_last_layers=4),
    Fp8Recipe("nvfp4-46", "nvfp4", block=16, align=32, bf16_last_layers=4, four_over_six=True),
)}
# `--fp8-emulate`: the block-scaled recipes' numerics where their tensor cores are missing, under their
# own names, so that every report, summary and log line that names the recipe says "emulated".
EMULATED = {f"{name}-emulated": name for name, r in RECIPES.items() if r.scaling in ("mx", "nvfp4")}
RECIPES.update({e: replace(RECIPES[name], name=e, emulated=True) for e, name in EMULATED.items()})
DEFAULT_RECIPE = "rowwise"


def get_recipe(name: str) -> Fp8Recipe:
    """The recipe called `name`; ValueError naming the recipes for any other name."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


# Where FP8 pays: the size rule. An FP8 projection adds passes that read and write its operands (the
# quantizing casts: bytes in proportion to tokens x (in + out)) to save matmul time (in proportion to
# tokens x in x out). Their ratio is tokens x in x out / (tokens x (in + out)) = in x out / (in + out),
# the projection's harmonic width, whatever the token count: a narrow projection does too little
# arithmetic per byte for the faster matmul to pay for its casts. `benchmark_kernels.py --fp8-crossover`
# times one projection's forward and backward both ways, captured as CUDA graphs, over widths from
# SmolLM2-135M's to LLaMA 3.1 8B's; FP8_MIN_WIDTH is read off those rows (docs/fp8.md, "Where FP8 pays"):
# on an H100 at 4,096 and 8,192 tokens, FP8 ran at 0.30-0.57x of bf16 for widths 144-512, 0.72-0.92x at
# 819-1,024, and 1.20-1.47x from 2,048 up (results/runs/fp8_crossover_H100.log); the rule keeps bf16 below
# 1,536, between the last width that lost and the first that gained. Projections that read the same
# input (q/k/v, gate/up) share its quantization, so they are judged together, as one projection whose
# out_features is their sum: LLaMA 3.1 8B's k and v (4,096 -> 1,024 each) go with q (4,096 -> 6,144 together).
FP8_MIN_WIDTH = 1536


def harmonic_width(in_features: int, out_features: int) -> float:
    return in_features * out_features / (in_features + out_features)


def size_reason(in_features: int, out_features: int) -> str | None:
    """Why a projection this size stays bf16 under the size rule (`--fp8-layers auto`), or None."""
    width = harmonic_width(in_features, out_features)
    if width < FP8_MIN_WIDTH:
        return (f"too small for FP8 to gain (harmonic width in x out / (in + out) = {width:.0f}, below the "
                f"measured crossover {FP8_MIN_WIDTH})")
    return None


def unsupported_reason(in_features: int, out_features: int, recipe: str = DEFAULT_RECIPE) -> str | None:
    """Why a [out_features, in_features] weight cannot go through the recipe's scaled matmul, or None."""
    r = get_recipe(recipe)
    step = r.align
    bad = [f"{name} = {n}" for name, n in (("in_features", in_features), ("out_features", out_features)) if n % step]
    if bad:
        why = ("as torch._scaled_mm requires" if step == ALIGN else f"as --fp8-recipe {recipe} requires (its blocks: "
               "Fp8Recipe.align)")
        return f"{' and '.join(bad)} not a multiple of {step}, {why}"
    if in_features > MAX_COLS or out_features > MAX_COLS:
        return f"a dimension above {MAX_COLS} (the quantizing kernel holds a whole row)"
    return None


def expected_patches(config, recipe: str = DEFAULT_RECIPE) -> int:
    """Decoder projections the recipe runs in FP8: those whose dimensions its scaled matmul takes (7 per
    layer, 4 in Phi-3, fused), in the decoder layers it does not keep in bf16."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    if config.model_type == "phi3":  # (in, out) of qkv_proj, o_proj, gate_up_proj, down_proj
        shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]
    else:  # q, k, v, o, gate, up, down
        shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter),
                  (inter, hidden)]
    first, last = bf16_layer_counts(recipe, config.num_hidden_layers)
    layers = max(0, config.num_hidden_layers - first - last)
    return layers * sum(unsupported_reason(i, o, recipe) is None for i, o in shapes)


class Fp8KernelMismatch(RuntimeError):
    """A quantizing kernel wrote other bytes on this GPU than the plain-PyTorch reference computes."""


_probed: dict = {}
SCALING_NAMES = {"row": "row-wise", "tensor": "tensor-wise", "block": "block-wise", "mx": "MXFP8", "nvfp4": "NVFP4"}


def check_device(device: torch.device, recipe: str, probe: Callable[[torch.device, str], None]) -> None:
    """Refuse, with a clear message, a device that cannot run the recipe's scaled FP8 matmuls.

    CPU: allowed (PyTorch's CPU `_scaled_mm` is a slow reference, the kernels run in Triton's
    interpreter, and the block and MX matmuls are computed from dequantized operands), so every test
    runs without a GPU. CUDA: compute capability 8.9 or newer (Ada, Hopper, Blackwell), and once per
    device and scaling (`probe`) the recipe's quantizers that write a transposed copy are
    checked bit for bit against the reference and a small matmul of its scaling is run with the flags
    training uses, so that a Triton or PyTorch build that cannot do either on this GPU fails here, at
    set-up, in one line, instead of in (or silently through) training. Per GPU family (`gpu_arch`):
      row-wise, tensor-wise   cuBLAS on sm_89 and sm_90; PyTorch's CUTLASS row-wise kernel on
                              Blackwell, where fast accumulation is left off (`fast_accum_allowed`)
      block-wise              PyTorch runs 1x128 / 128x128 scales through cuBLAS on Hopper only; the
                              probe also checks the values against the dequantized product
      mxfp8, nvfp4            Blackwell (10.x, 12.x) and newer: torch._scaled_mm's MXFP8 / NVFP4 matmul,
                              probed like block-wise; Ada and Hopper have no block-scaled tensor cores:
                              refused in one line (`mx_missing`) unless the user asks for the emulated
                              recipe (`--fp8-emulate`: its accuracy, slower than bf16, never a speed)
    `probe(device, scaling)` (scaling with "-emulated" appended for an emulated recipe): the lesson's
    check of the recipe's quantizers and matmuls on this device
    (fp8_linear_kernel.probe_scaled_mm for row-wise scales, fp8_recipes_kernel.probe_scaled_mm for the
    others); RuntimeError if PyTorch refuses one, Fp8KernelMismatch if a quantizer writes other bytes.
    """
    r = get_recipe(recipe)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise RuntimeError(f"FP8 linear layers need a CUDA GPU of compute capability 8.9 or newer (or the CPU, for "
                           f"tests); the tensors are on {device}")
    if torch.version.hip is not None:
        raise RuntimeError("FP8 linear layers use float8_e4m3fn, NVIDIA's FP8; ROCm GPUs (MI300: e4m3fnuz) are not "
                           "supported: train without --fp8")
    major, minor = gpu_arch.device_capability(device)
    family = gpu_arch.arch_family((major, minor))
    if (major, minor) < (8, 9):
        raise RuntimeError(f"FP8 matmuls need compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                           f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: train without --fp8")
    has_mx = family not in (gpu_arch.OLDER, gpu_arch.HOPPER)
    if r.scaling in ("mx", "nvfp4") and not has_mx and not r.emulated:
        raise RuntimeError(mx_missing(major, minor, recipe))
    if r.scaling == "block" and family != gpu_arch.HOPPER:
        raise RuntimeError(f"--fp8-recipe blockwise: PyTorch's 1x128 / 128x128 block-scaled FP8 matmul (cuBLAS) runs "
                           f"on Hopper (sm_90) only, and this GPU is sm_{major}{minor}: use --fp8-recipe rowwise"
                           + (" (mxfp8 is this GPU's block format)" if has_mx else ""))
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.__version__, triton.__version__, r.scaling, r.emulated)
    if key not in _probed:
        try:
            probe(torch.device("cuda", index), r.scaling + ("-emulated" if r.emulated else ""))
            _probed[key] = None
        except Fp8KernelMismatch as err:
            _probed[key] = str(err)
        except RuntimeError as err:
            kind = SCALING_NAMES[r.scaling]
            _probed[key] = (f"this PyTorch ({torch.__version__}) has no usable {kind} scaled FP8 matmul for "
                            f"sm_{major}{minor} ({str(err).splitlines()[0][:200]}): use another --fp8-recipe, train "
                            "without --fp8, or try a newer PyTorch")
    if _probed[key]:
        raise RuntimeError(_probed[key])


def mx_missing(major: int, minor: int, recipe: str = "mxfp8") -> str:
    """Why --fp8-recipe mxfp8 or nvfp4 cannot run on a GPU of compute capability major.minor, before
    Blackwell: one line."""
    what = ("MX block-scaled FP8 tensor cores (1x32 blocks, e8m0 scales)" if get_recipe(recipe).scaling == "mx"
            else "NVFP4 block-scaled FP4 tensor cores (1x16 blocks, e4m3 scales)")
    return (f"--fp8-recipe {recipe} needs {what}, which Blackwell (compute capability 10.0 and newer) has and "
            f"this sm_{major}{minor} GPU has not: use --fp8-recipe rowwise, or add --fp8-emulate to measure its "
            "accuracy (same quantization, bf16 matmuls, no speed)")


def bf16_layer_counts(recipe: str, n_layers: int) -> tuple[int, int]:
    """(first, last): how many of a model's n_layers decoder layers the recipe keeps in bf16 at each end."""
    r = get_recipe(recipe)
    return r.bf16_end_layers, max(r.bf16_end_layers, min(r.bf16_last_layers, n_layers // 8))


def emulated_name(recipe: str) -> str:
    """The recipe `--fp8-emulate` runs for `--fp8-recipe recipe` ('nvfp4' -> 'nvfp4-emulated'); ValueError
    for a recipe that has nothing to emulate (its matmuls run on Hopper's FP8 tensor cores)."""
    if get_recipe(recipe).emulated:
        return recipe
    name = f"{recipe}-emulated"
    if name not in EMULATED:
        raise ValueError(f"--fp8-emulate is for Blackwell's block-scaled formats ({', '.join(EMULATED.values())}); "
                         f"--fp8-recipe {recipe} runs natively on Hopper and newer")
    return name


def ptxas_release(device: torch.device) -> str:
    """'13.4': the ptxas release Triton assembles this GPU's kernels with, or 'unknown'."""
    if device.type != "cuda":
        return "unknown"
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
        major, minor = gpu_arch.device_capability(device)
        found = re.search(r"release (\d+\.\d+)", get_ptxas_version(10 * major + minor))
        return found.group(1) if found else "unknown"
    except Exception:  # another Triton layout, or no ptxas: the message still names Triton's version
        return "unknown"


def check_copies(device: torch.device, quantizers) -> None:
    """Fp8KernelMismatch (`transposed_store_mismatch`) unless every quantizer of `quantizers`, (what, quantize,
    reference) each, writes on `device` the bytes (FP8 copies and fp32 scales) its plain-PyTorch reference
    computes: `quantize(x)` and `reference(x)` give (q or None, scales, qT, scales), at 256 and 250 rows of 256.

    Why: Triton has miscompiled FP8 stores through a transposing layout conversion when the same kernel
    also stores the tensor untransposed: foreign bytes in the transposed copy, reported with ptxas 12.9
    (what Triton 3.8 assembles Hopper code with) and gone with ptxas 13.3 (triton-lang/triton#11111);
    Triton 3.9 assembles Hopper and Blackwell code with ptxas 13.4. Which kernels it hits depends on the
    ptxas release, the target and the launch configuration, so instead of a list of Triton versions the
    kernels that write both copies (and the transposed copy alone) are run once per GPU at set-up, at two
    token counts (a multiple of 16 and not, which Triton compiles apart), and compared bit for bit with
    the references, as the tests do."""
    g = torch.Generator(device="cpu").manual_seed(1)
    for M in (256, 250):
        x = (torch.randn(M, 256, generator=g) * torch.logspace(-3, 3, M)[:, None]).to(device, torch.bfloat16)
        for what, quantize, reference in quantizers:
            if "128x128" in what and M % 128:  # weights: whole tiles (Fp8Recipe.align)
                continue
            q, s, qt, st = quantize(x)
            rq, rs, rqt, rst = reference(x)
            bits = torch.equal  # of the FP8 bytes and the fp32 scales; a sync, once per device and scaling
            same = (bits(qt.view(torch.uint8), rqt.view(torch.uint8)) and bits(st.reshape(rst.shape), rst)
                    and (q is None or (bits(q.view(torch.uint8), rq.view(torch.uint8))
                                       and bits(s.reshape(rs.shape), rs))))
            if not same:
                raise transposed_store_mismatch(what, M, device)


def transposed_store_mismatch(what: str, rows: int, device: torch.device) -> Fp8KernelMismatch:
    """The error of a transposing quantizer that wrote other bytes than its reference (`what`, `rows` x 256)."""
    import triton

    where = gpu_arch.describe(gpu_arch.device_capability(device)) if device.type == "cuda" else "the CPU"
    return Fp8KernelMismatch(
        f"FP8 quantizer ({what}, {rows} x 256) on {where} wrote other bytes than the PyTorch reference "
        f"with Triton {triton.__version__} (ptxas {ptxas_release(device)}): an FP8 transposed store "
        "miscompiled (triton-lang/triton#11111: ptxas 12.9, gone with 13.3); use a Triton that assembles "
        "with ptxas 13.3 or newer (3.9 does), or point TRITON_PTXAS_PATH at a CUDA 13.3+ ptxas, or train "
        "without --fp8")


_fast_accum: dict = {}


def fast_accum_allowed(device: torch.device) -> bool:
    """Whether the forward matmul may use fast accumulation on this device.

    It is a Hopper (and Ada) setting: their FP8 tensor cores keep about 14 bits of the running sum
    unless the matmul promotes it to fp32 now and then, which fast accumulation skips. Data-centre
    Blackwell (sm_100, sm_103) accumulates in fp32 whatever the flag says, and PyTorch runs its
    row-wise matmul through a different (CUTLASS) kernel: there the flag is left off. Consumer
    Blackwell (sm_120) and unrecognised GPUs leave it off too: off is the precise setting (the sum is
    promoted to fp32), and no measurement there says the flag is both safe and faster. Decided by
    family (`gpu_arch`), so 10.3 takes 10.0's setting. The CPU ignores it."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _fast_accum:
        _fast_accum[index] = gpu_arch.device_family(index) in (gpu_arch.HOPPER, gpu_arch.OLDER)
    return _fast_accum[index]


def compiled_graph_trusted(device: torch.device) -> bool:
    """Whether torch.compile may trace the FP8 layer into its graph on this device.

    Not on CUDA: on an H100 and an H200 (torch 2.11, Triton 3.6) the compiled graph's input gradient
    differed from eager's by the size of the gradient itself (fp8_linear_test.py's compile test), with
    the quantizers and the scaled matmul all opaque custom operators; the cause is not found yet. On a
    GPU a compiled model therefore runs each FP8 layer eagerly (a graph break around it): correct, and
    the rest of the model is still compiled. The CPU's compiled graph equals eager's bit for bit.
    """
    return device.type != "cuda"

