"""The bug zoo: silent bugs of distributed training, reproduced by patching megatron-core at run time.

Each `ZooBug` names one historical Megatron-LM / TransformerEngine bug class, the layouts that
trigger it (flags of `ttrace example megatron-gpt`), the ground truth a localizer should find
(`culprit`, `first_divergence`) and an `apply()` that patches megatron-core 0.16.1 and returns the
undo function. Apply it in the candidate run only, before building the model; the reference runs
unpatched. The patches themselves are in bug_patches.py, each marked with a `# BUG:` comment.

    undo = apply_bug("sp-final-norm-grad")
    ...build and train the candidate...
    undo()

Bugs (name: what is patched -> trigger):

- sp-final-norm-grad: finalize_model_grads._allreduce_non_tensor_model_parallel_grads skips
  decoder.final_layernorm -> --tp 2 --sp
- sp-router-replica: the same all-reduce skips the MoE routers -> --tp 2 --sp with MoE
- attn-dq-wrong: DotProductAttention.forward, dQ taken from the neighbouring head -> any layout
- cp-attn-backward: not runnable on CPU (megatron's CP needs TransformerEngine) -> torch-gpt, later
- pp-tied-embedding-grad: finalize_model_grads._allreduce_word_embedding_grads skipped -> --pp 2, tied
- distopt-stale-params: _ParamAndGradBucketGroup.start_param_sync skipped -> --dp 2 --dist-opt
- vocab-embedding-mask: VocabParallelEmbedding.forward masks shifted ids -> --tp 2
- row-parallel-bias-per-rank: RowParallelLinear.forward adds the bias before the reduction -> --tp 2
- sp-gather-wrong-dim: tensor_parallel.layers.dist_all_gather_func, the wgrad input re-gather
  concatenates along the hidden dim -> --tp 2 --sp
- swiglu-tp-shard: MLP.forward swaps gate/up halves on odd TP ranks -> --tp 2 with SwiGLU
- fp8-amax-wrong-group: ttrace_core.integrations.fp8.reduced_amaxes uses the DP group -> --tp 2 fp8
- expert-grad-scale: DistributedDataParallel.__init__ mis-scales the expert buffers -> --dp 2 --ep 2
- expert-probs-twice: MLP.forward of EP rank 1's first expert applies the routing probs again -> --dp 2 --ep 2
- loss-scale-dp-cp: schedules.forward_step_calc_loss divides by global micro-batches -> --dp 2
- dp-grad-avg-twice: _ParamAndGradBucketGroup.start_grad_sync divides by dp again -> --dp 2

Flags the megatron-gpt example does not have yet are written as they would be spelled: --moe, --ep
(MoE on CPU needs the local spec with moe_grouped_gemm=False, the allgather dispatcher,
add_bias_linear=False, expert_model_parallel_size in the TransformerConfig, and
megatron.core.transformer.moe.moe_utils.te_general_gemm = None without TransformerEngine) and --cp.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from ttrace_core.format.naming import LOSS_FUNCTION, owner_of
from ttrace_examples.megatron_gpt import bug_patches as patches
from ttrace_examples.megatron_gpt import model_bugs

BUG_CLASSES = ("gradient-sync", "kernel-backward", "layout", "scaling", "stale-state", "model-code")
RUNS_ON = ("megatron-core", "torch-gpt")


@dataclass(frozen=True, kw_only=True)
class ZooBug:
    name: str
    """The --bug value."""
    upstream: str
    """The report it reproduces, e.g. "Megatron-LM #1446"."""
    bug_class: str
    """One of BUG_CLASSES: "gradient-sync" (missing/extra/wrong-group collective on grads),
    "kernel-backward", "layout" (wrong shard/concat), "scaling", "stale-state", "model-code" (the model
    itself is wrong at every layout: only an independent reference sees it, docs/porting.md)."""
    description: str
    """One sentence: what goes wrong."""
    triggers: tuple[str, ...]
    """Layouts that trigger it, as flags of `ttrace example megatron-gpt`."""
    culprit: str
    """Ground truth: a module fqn in megatron's GPTModel, or for a gradient-sync bug the params and
    the reduction that misses them."""
    first_divergence: str
    """The first tensor expected to diverge: "<phase> / <fqn> / <slot>" in ttrace terms."""
    runs_on: str
    """"megatron-core", or "torch-gpt" where megatron-core cannot run the bug on CPU."""
    apply: Callable[[], Callable[[], None]]
    """Patches megatron-core (or the named integration) and returns the undo function."""

    def __post_init__(self) -> None:
        if self.bug_class not in BUG_CLASSES:
            raise ValueError(f"bug {self.name!r}: bug_class {self.bug_class!r} is not one of {BUG_CLASSES}")
        if self.runs_on not in RUNS_ON:
            raise ValueError(f"bug {self.name!r}: runs_on {self.runs_on!r} is not one of {RUNS_ON}")
        if self.first_divergence.split(" / ")[0] not in ("forward", "backward", "grad", "param"):
            raise ValueError(f"bug {self.name!r}: first_divergence {self.first_divergence!r} must start with a phase")


_BUGS = (
    ZooBug(
        name="sp-final-norm-grad", upstream="Megatron-LM #1446", bug_class="gradient-sync",
        description="Under sequence parallelism the final LayerNorm's weight and bias grads, partial sums over "
                    "each rank's sequence shard, are not all-reduced over TP, so each TP rank steps with its own part.",
        triggers=("--tp 2 --sp",),
        culprit="decoder.final_layernorm.{weight,bias} main_grad: TP all-reduce of sequence-parallel grads",
        first_divergence="grad / decoder.final_layernorm.weight / grad",
        runs_on="megatron-core", apply=patches.apply_final_norm_grad_not_reduced),
    ZooBug(
        name="sp-router-replica", upstream="Megatron-LM #599", bug_class="gradient-sync",
        description="Under sequence parallelism the MoE routers' weight grads are not all-reduced over TP, so the "
                    "router replicas on the TP ranks drift apart from the first step on (needs a MoE model: "
                    "local spec with num_experts, allgather dispatcher, no linear biases on CPU).",
        triggers=("--tp 2 --sp --moe",),
        culprit="decoder.layers.*.mlp.router.weight main_grad: TP all-reduce of sequence-parallel grads",
        first_divergence="grad / decoder.layers.0.mlp.router.weight / grad",
        runs_on="megatron-core", apply=patches.apply_router_grad_not_reduced),
    ZooBug(
        name="attn-dq-wrong", upstream="TransformerEngine #1615 (like)", bug_class="kernel-backward",
        description="Core attention's forward is exact but its backward hands each query head the gradient of "
                    "the next head, so dQ (and every grad upstream of it) is wrong while the loss is right.",
        triggers=("--tp 1", "--tp 2", "--tp 2 --sp"),
        culprit="decoder.layers.*.self_attention.core_attention",
        first_divergence="backward / decoder.layers.3.self_attention.core_attention / grad_input.0",
        runs_on="megatron-core", apply=patches.apply_attention_wrong_dq),
    ZooBug(
        name="cp-attn-backward", upstream="Megatron-LM #1464 (like)", bug_class="kernel-backward",
        description="Context-parallel attention's backward keeps only the local queries' dK/dV instead of "
                    "reduce-scattering them over the CP group. megatron-core's CP needs TransformerEngine "
                    "attention, which cannot run on CPU, so the bug lives in torch-gpt (`ttrace example "
                    "torch-gpt --cp 2 --bug cp-attn-backward`), whose CP attention all-gathers K/V.",
        triggers=("--cp 2",),
        culprit="layers.*.attn (torch-gpt): the backward of the context-parallel K/V all-gather",
        first_divergence="backward / layers.3.attn.wv / grad_output.0",
        runs_on="torch-gpt", apply=patches.apply_cp_attention_backward),
    ZooBug(
        name="pp-tied-embedding-grad", upstream="Megatron-LM #844, #656", bug_class="gradient-sync",
        description="With tied input/output embeddings split over the first and last pipeline stage, the two "
                    "stages' partial grads of the shared weight are never summed, so each copy steps with half.",
        triggers=("--pp 2 --tie-embeddings",),
        culprit="embedding.word_embeddings.weight / output_layer.weight main_grad: all-reduce over the "
                "embedding group (first and last pipeline stage)",
        first_divergence="grad / embedding.word_embeddings.weight / grad",
        runs_on="megatron-core", apply=patches.apply_tied_embedding_grad_not_reduced),
    ZooBug(
        name="distopt-stale-params", upstream="Megatron-LM #663, #950", bug_class="stale-state",
        description="After the distributed optimizer's step the updated parameter shards are not all-gathered, "
                    "so every DP rank keeps stale values in the shards it does not own and step 2's forward "
                    "runs on half-updated weights.",
        triggers=("--dp 2 --dist-opt",),
        culprit="all parameters outside each DP rank's optimizer shard: distributed-optimizer param all-gather "
                "over DP after optimizer.step()",
        first_divergence="param / embedding.word_embeddings.weight / value",
        runs_on="megatron-core", apply=patches.apply_skip_param_all_gather),
    ZooBug(
        name="vocab-embedding-mask", upstream="Slapo (vocab-parallel embedding mask)", bug_class="layout",
        description="The vocab-parallel embedding tests the id range after shifting ids into the rank's local "
                    "range, so every rank but the first masks all its ids and those tokens embed to zero.",
        triggers=("--tp 2", "--tp 2 --sp"),
        culprit="embedding.word_embeddings",
        first_divergence="forward / embedding.word_embeddings / output.0",
        runs_on="megatron-core", apply=patches.apply_vocab_embedding_shifted_mask),
    ZooBug(
        name="row-parallel-bias-per-rank", upstream="Megatron-LM RowParallelLinear bias (class)", bug_class="layout",
        description="Every RowParallelLinear (linear_proj, linear_fc2) adds its bias to each rank's partial sum "
                    "before the all-reduce (reduce-scatter under SP), so the output carries tp times the bias "
                    "(invisible while biases are zero, megatron's default initialization).",
        triggers=("--tp 2", "--tp 2 --sp"),
        culprit="decoder.layers.0.self_attention.linear_proj",
        first_divergence="forward / decoder.layers.0.self_attention.linear_proj / output.0",
        runs_on="megatron-core", apply=patches.apply_row_parallel_bias_per_rank),
    ZooBug(
        name="sp-gather-wrong-dim", upstream="TransformerEngine #530", bug_class="layout",
        description="Under sequence parallelism the column-parallel linears re-gather their input for the weight "
                    "grad along the hidden dim instead of the sequence dim, so forward and activation grads "
                    "are right but the weight grads of linear_qkv, linear_fc1 and output_layer are wrong.",
        triggers=("--tp 2 --sp",),
        culprit="output_layer, decoder.layers.*.self_attention.linear_qkv, decoder.layers.*.mlp.linear_fc1 "
                "(weight grad of column-parallel linears under SP)",
        first_divergence="grad / decoder.layers.0.self_attention.linear_qkv.weight / grad",
        runs_on="megatron-core", apply=patches.apply_sp_gather_wrong_dim),
    ZooBug(
        name="swiglu-tp-shard", upstream="Megatron-LM #985", bug_class="layout",
        description="With SwiGLU under TP each rank holds [gate_r; up_r] of fc1, but odd TP ranks split their "
                    "local output as [up; gate], so the activation is wrong only under TP.",
        triggers=("--tp 2 --swiglu",),
        culprit="decoder.layers.*.mlp (GLU split of linear_fc1's output)",
        first_divergence="forward / decoder.layers.0.mlp.linear_fc2 / input.0",
        runs_on="megatron-core", apply=patches.apply_swiglu_tp_shard),
    ZooBug(
        name="fp8-amax-wrong-group", upstream="Megatron-LM #442, TransformerEngine #335", bug_class="scaling",
        description="In the emulated FP8 recipe the amaxes are all-reduced over the data-parallel group instead "
                    "of the TP group, so TP ranks quantize their shards of one logical tensor with different scales.",
        triggers=("--tp 2 --precision fp8",),
        culprit="decoder.layers.0.self_attention.linear_qkv (FP8 amax reduction group of every fp8 linear)",
        first_divergence="forward / decoder.layers.0.self_attention.linear_qkv.fp8_scale_inv / input.1",
        runs_on="megatron-core", apply=patches.apply_fp8_amax_wrong_group),
    ZooBug(
        name="expert-grad-scale", upstream="Megatron-LM commit 'Fix dist opt grad scale when TP != expert-TP'",
        bug_class="scaling",
        description="Expert-parallel grads are pre-scaled with the expert-DP size instead of the DP size, wrong "
                    "by dp/expert_dp whenever the expert layout (ETP x EP) differs from the dense one (TP), "
                    "e.g. 2x with DP2 EP2 (upstream: TP != expert-TP, which needs 4+ ranks to show).",
        triggers=("--dp 2 --ep 2 --moe", "--dp 2 --ep 2 --moe --dist-opt"),
        culprit="decoder.layers.*.mlp.experts.* main_grad: expert-DP gradient scaling factor",
        first_divergence="grad / decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight / grad",
        runs_on="megatron-core", apply=patches.apply_expert_grad_scale),
    ZooBug(
        name="expert-probs-twice", upstream="Megatron-LM MoE probs applied in expert and unpermute (class)",
        bug_class="scaling",
        description="One expert-parallel rank's first expert multiplies its output by the tokens' routing "
                    "probabilities a second time (an old code path on one rank applying the probs in the "
                    "expert and again at unpermute), so that expert's output is wrong only on that rank.",
        triggers=("--dp 2 --ep 2 --moe --num-experts 4 --dispatcher alltoall",),
        culprit="decoder.layers.*.mlp.experts.local_experts.2 (global expert 2, local expert 0 of EP rank 1)",
        first_divergence="forward / decoder.layers.0.mlp.experts.local_experts.2 / output.0",
        runs_on="megatron-core", apply=patches.apply_expert_probs_twice),
    ZooBug(
        name="loss-scale-dp-cp", upstream="Megatron-LM loss scaling under DP/CP (class)", bug_class="scaling",
        description="The schedule divides each micro-batch loss by the global number of micro-batches "
                    "(local x DP) while DDP also averages over DP, so every gradient is dp times too small.",
        triggers=("--dp 2",),
        culprit="the loss, between output_layer's forward output and its backward: pipeline_parallel/schedules.py "
                "forward_step_calc_loss num_microbatches",
        first_divergence="backward / output_layer / grad_output.0",
        runs_on="megatron-core", apply=patches.apply_loss_scale_global_microbatches),
    ZooBug(
        name="dp-grad-avg-twice", upstream="Megatron-LM DDP grad averaging (class)", bug_class="gradient-sync",
        description="DDP's grad reduction divides the grads by dp once more on top of its own averaging, so "
                    "every reduced gradient is dp times too small.",
        triggers=("--dp 2", "--dp 2 --dist-opt"),
        culprit="all parameters main_grad: DP gradient reduction (average applied twice)",
        first_divergence="grad / embedding.word_embeddings.weight / grad",
        runs_on="megatron-core", apply=patches.apply_grad_average_twice),
)

ZOO: dict[str, ZooBug] = {bug.name: bug for bug in _BUGS}
"""The layout bugs: each caught against the same-code one-rank reference (the detection benchmark's zoo)."""

# Model-code bugs (model_bugs.py): the same wrong model at every layout, so the same-code one-rank reference
# passes them; against the HF Llama reference (`ttrace compare HF CAND --map hf-llama--megatron-gpt`) each is
# caught. Their culprit is the smallest module the HF reference can feed: core attention's query and key
# inputs (after rotary) have no HF counterpart, so a bug inside core attention is named by self_attention.
_MODEL_CODE_BUGS = (
    ZooBug(
        name="proj-transposed", upstream="DeepSeek-V4 HyperConnection comb vs comb^T (Megatron-LM #4957, NeMo #2154; class)",
        bug_class="model-code",
        description="The attention's output projection applies its square weight transposed (x W instead of "
                    "x W^T), as a port from a checkpoint that stores [in, out] does: no shape error, every layout alike.",
        triggers=("--llama --tp 1", "--llama --tp 2", "--llama --tp 2 --sp"),
        culprit="decoder.layers.*.self_attention.linear_proj",
        first_divergence="forward / decoder.layers.0.self_attention.linear_proj / output.0",
        runs_on="megatron-core", apply=model_bugs.apply_projection_transposed),
    ZooBug(
        name="rotary-interleaved", upstream="rotary layout mismatch (interleaved vs half-split; class)",
        bug_class="model-code",
        description="Rotary embeddings pair each head's dims interleaved (x0 y0 x1 y1, GPT-J) where Llama and its "
                    "weights pair the two halves (x0 x1 | y0 y1): a consistent rotary, just not the model's.",
        triggers=("--llama --tp 1", "--llama --tp 2", "--llama --tp 2 --sp"),
        culprit="decoder.layers.*.self_attention (rotary applied between linear_qkv and core_attention)",
        first_divergence="forward / decoder.layers.0.self_attention.core_attention.scale_mask_softmax / output.0",
        runs_on="megatron-core", apply=model_bugs.apply_rotary_interleaved),
    ZooBug(
        name="gqa-tiled-groups", upstream="grouped-query attention: repeat vs repeat_interleave (class)",
        bug_class="model-code",
        description="Query head h attends with key/value group h mod G instead of h div (H / G): the groups "
                    "tiled, not each repeated for its own queries (needs --num-query-groups below the heads).",
        triggers=("--llama --num-query-groups 2 --tp 1", "--llama --num-query-groups 2 --tp 2 --sp"),
        culprit="decoder.layers.*.self_attention.core_attention (named as self_attention against HF)",
        first_divergence="forward / decoder.layers.0.self_attention.core_attention.scale_mask_softmax / output.0",
        runs_on="megatron-core", apply=model_bugs.apply_gqa_tiled_groups),
    ZooBug(
        name="norm-eps-outside-sqrt", upstream="RMSNorm epsilon placement (class)",
        bug_class="model-code",
        description="RMSNorm divides by sqrt(mean(x^2)) + eps instead of sqrt(mean(x^2) + eps): a relative "
                    "error of about eps / rms, at every norm of every layout.",
        triggers=("--llama --tp 1", "--llama --tp 2 --sp"),
        culprit="decoder.layers.*.input_layernorm, decoder.layers.*.pre_mlp_layernorm, decoder.final_layernorm",
        first_divergence="forward / decoder.layers.0.input_layernorm / output.0",
        runs_on="megatron-core", apply=model_bugs.apply_norm_eps_outside_sqrt),
    ZooBug(
        name="router-topk-unnormalized", upstream="MoE router: softmax before top-k without renormalizing (class)",
        bug_class="model-code",
        description="The MoE router keeps the top-k of the softmax over all experts as the experts' weights, where "
                    "Mixtral divides them by their sum: each token's expert outputs scaled by the mass of its top k "
                    "(against the HF Mixtral reference, --map hf-mixtral--megatron-gpt-moe).",
        triggers=("--llama --moe --num-experts 4 --tp 1", "--llama --moe --num-experts 4 --dp 2 --ep 2"),
        culprit="decoder.layers.*.mlp (the router inside it: its probabilities have no HF counterpart)",
        first_divergence="forward / decoder.layers.0.mlp / output.0",
        runs_on="megatron-core", apply=model_bugs.apply_router_topk_unnormalized),
)

MODEL_CODE_BUGS: dict[str, ZooBug] = {bug.name: bug for bug in _MODEL_CODE_BUGS}
"""The model-code bugs: each passes the same-code reference and is caught against the HF reference
(benchmarks/porting.py); kept apart from ZOO, whose bugs the same-code reference catches."""
ALL_BUGS: dict[str, ZooBug] = {**ZOO, **MODEL_CODE_BUGS}


def apply_bug(name: str) -> Callable[[], None]:
    """Apply the named bug's patch (the zoo's or a model-code bug); returns the undo function."""
    if name not in ALL_BUGS:
        raise ValueError(f"unknown bug {name!r}; choose one of: {', '.join(ALL_BUGS)}")
    return ALL_BUGS[name].apply()


@dataclass(frozen=True, kw_only=True)
class CulpritTruth:
    """What a localizer must name for a bug, in matchable form (the `culprit` text, as globs)."""

    modules: tuple[str, ...] = ()
    """fnmatch globs of modules, for bugs inside a module; naming a descendant counts. The loss function
    is the pseudo-module LOSS_FUNCTION; other code outside every traced module (the schedule) is named
    by its neighbours: "between A (...) and B (...)"."""
    params: str = ""
    """fnmatch glob of the parameters, for bugs outside modules (gradient sync, scaling, optimizer)."""
    reduction: str = ""
    """The reduction at fault for those parameters: "TP", "DP", "EP", "PP-embedding", "optimizer"."""

    def names_module(self, fqn: str) -> bool:
        return any(fnmatch.fnmatchcase(fqn, g) or fnmatch.fnmatchcase(fqn, g + ".*") for g in self.modules)

    def names_sync(self, params: list[str], reduction: str) -> bool:
        return bool(self.params) and reduction.startswith(self.reduction) and \
            any(fnmatch.fnmatchcase(p, self.params) for p in params)


CULPRITS: dict[str, CulpritTruth] = {
    "sp-final-norm-grad": CulpritTruth(params="decoder.final_layernorm.*", reduction="TP"),
    "sp-router-replica": CulpritTruth(params="decoder.layers.*.mlp.router.*", reduction="TP"),
    "attn-dq-wrong": CulpritTruth(modules=("decoder.layers.*.self_attention.core_attention",)),
    "cp-attn-backward": CulpritTruth(modules=("layers.*.attn",)),
    "pp-tied-embedding-grad": CulpritTruth(params="embedding.word_embeddings.weight", reduction="PP-embedding"),
    "distopt-stale-params": CulpritTruth(params="*", reduction="optimizer"),
    "vocab-embedding-mask": CulpritTruth(modules=("embedding.word_embeddings",)),
    "row-parallel-bias-per-rank": CulpritTruth(modules=("decoder.layers.*.self_attention.linear_proj",
                                                        "decoder.layers.*.mlp.linear_fc2")),
    "sp-gather-wrong-dim": CulpritTruth(modules=("output_layer", "decoder.layers.*.self_attention.linear_qkv",
                                                 "decoder.layers.*.mlp.linear_fc1")),
    "swiglu-tp-shard": CulpritTruth(modules=("decoder.layers.*.mlp",)),
    "fp8-amax-wrong-group": CulpritTruth(modules=("decoder.layers.*.linear_qkv", "decoder.layers.*.linear_proj",
                                                  "decoder.layers.*.linear_fc1", "decoder.layers.*.linear_fc2")),
    "expert-grad-scale": CulpritTruth(params="decoder.layers.*.mlp.experts.*", reduction="EP"),
    "expert-probs-twice": CulpritTruth(modules=("decoder.layers.*.mlp.experts.local_experts.2",)),
    "loss-scale-dp-cp": CulpritTruth(modules=(LOSS_FUNCTION,)),
    "dp-grad-avg-twice": CulpritTruth(params="*", reduction="DP"),
}
MODEL_CODE_CULPRITS: dict[str, CulpritTruth] = {
    "proj-transposed": CulpritTruth(modules=("decoder.layers.*.self_attention.linear_proj",)),
    "rotary-interleaved": CulpritTruth(modules=("decoder.layers.*.self_attention",)),
    "gqa-tiled-groups": CulpritTruth(modules=("decoder.layers.*.self_attention",)),
    "norm-eps-outside-sqrt": CulpritTruth(modules=("decoder.layers.*.input_layernorm", "decoder.layers.*.pre_mlp_layernorm",
                                                   "decoder.final_layernorm")),
    "router-topk-unnormalized": CulpritTruth(modules=("decoder.layers.*.mlp",)),
}


def localized_correctly(bug_name: str, localization) -> bool:
    """Does a `localize.Localization` name the bug's ground truth first?"""
    truth = {**CULPRITS, **MODEL_CODE_CULPRITS}[bug_name]
    first_module = next((m.fqn for m in localization.modules if m.verdict == "introduces error"), None)
    if truth.modules:
        return first_module is not None and truth.names_module(first_module)
    return first_module is None and any(truth.names_sync(s.params, s.reduction) for s in localization.sync)


def first_tensor_points_at(bug_name: str, phase: str, fqn: str) -> bool:
    """Would blaming the first failing tensor's module (or parameter) find the bug?"""
    truth = CULPRITS[bug_name]
    if truth.modules:
        module = owner_of(fqn) if phase in ("grad", "param") else fqn
        return truth.names_module(module)
    return phase in ("grad", "param") and fnmatch.fnmatchcase(fqn, truth.params)
