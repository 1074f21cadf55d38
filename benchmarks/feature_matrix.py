"""`ttrace check` over the feature combinations of the pinned frameworks that run on CPU.

Each group is one `ttrace check` config, written to WORK/GROUP/check.toml: the group's features are
on in the one-rank reference and in every candidate alike (so each candidate is the same logical
training step), the candidates add a parallel layout. The configs are what a user would write; the
group's check.json is read back as is. Groups:

- megatron-core 0.16.1 through the megatron-gpt example (`python -m ttrace_examples megatron-gpt
  FIELD=VALUE ...`; 4 layers, hidden 64, 4 micro-batches of 2 x 16 tokens per step, so every run
  accumulates gradients): tied embeddings, per-token loss normalization, multi-token prediction,
  MoE with aux_loss / seq_aux_loss / global_aux_loss and z-loss under the allgather and alltoall
  dispatchers, shared experts, the distributed optimizer, SP, EP and virtual pipelines;
- torchtitan 0.3.0's own Trainer (`python -m ttrace_examples.torchtitan`): gradient accumulation
  (global batch 8 of local 2) under FSDP2 and TP2, the qwen3 MoE debug model under EP2 and FSDP2 with
  gradient accumulation, the deepseek_v3 debug model under EP2;
- transformers 5.24's own TP (tests/thirdparty/hf_tp_train.py): dense and MoE TP2 with 2
  micro-batches per step.

Writes results/feature_matrix.{md,json}: per group its framework, features, precision and whether it
has MoE; per configuration its verdict, the first divergence, the ratio and the culprit. `--only`
re-runs some groups and keeps the others' rows from the existing json.

    python benchmarks/feature_matrix.py [--only GROUP ...] [--work /var/tmp/ttrace-feature-matrix]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HF_SCRIPT = ROOT / "tests" / "thirdparty" / "hf_tp_train.py"

MEGATRON = "python -m ttrace_examples megatron-gpt precision={precision} {layout}"
TORCHTITAN = ("torchrun --standalone --nproc-per-node {world_size} -m ttrace_examples.torchtitan {layout} "
              "--training.local_batch_size 2 --training.global_batch_size 8 --training.mixed_precision_param float32")
TRANSFORMERS = f"torchrun --standalone --nproc-per-node {{world_size}} {HF_SCRIPT} {{layout}}"


@dataclass(kw_only=True, slots=True)
class Group:
    name: str
    framework: str
    features: str
    """The reference's arguments; every candidate's start with them."""
    candidates: list[tuple[str, str, int]]
    """(name, the layout's own arguments, world size)."""
    moe: bool = False
    """Has MoE layers (whose expert activations are not traced yet: re-run once they are)."""
    precisions: tuple[str, ...] = ("fp32",)
    estimate_samples: int = 4
    about: str = ""


MOE4 = "model.num_experts=4 model.moe_topk=2"
TT_LLAMA = "--module ttrace_examples.torchtitan --config llama3_debugmodel --training.steps 1 --training.seq_len 256"
# 128 tokens for the MoE models: their traces (one row per token and expert) take about 5 GB per run at 256.
TT_QWEN = "--module ttrace_examples.torchtitan --config qwen3_moe_debug_2layers --training.steps 1 --training.seq_len 128"
TT_DEEPSEEK = "--module ttrace_examples.torchtitan --config deepseek_v3_debugmodel --training.steps 1 --training.seq_len 128"
TT_TP2, TT_FSDP2 = "--parallelism.tensor_parallel_degree 2", "--parallelism.data_parallel_shard_degree 2"
TT_EP2 = "--parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2"

GROUPS = [
    Group(name="mg-tied", framework="megatron-core", features="model.tie_embeddings=true",
          candidates=[("tp2-sp", "tp=2 sp=true", 2), ("pp2", "pp=2", 2), ("dp2-distopt", "dp=2 dist_opt=true", 2),
                      ("tp2", "tp=2", 2)],
          precisions=("fp32", "bf16"), about="tied embeddings (summed across the first and last stage under PP)"),
    Group(name="mg-per-token", framework="megatron-core", features="per_token_loss=true",
          candidates=[("tp2", "tp=2", 2), ("pp2", "pp=2", 2), ("dp2", "dp=2", 2)],
          about="calculate_per_token_loss: gradients divided by the global token count"),
    Group(name="mg-mtp", framework="megatron-core", features="mtp_num_layers=1",
          candidates=[("tp2-sp", "tp=2 sp=true", 2), ("pp2", "pp=2", 2), ("dp2-distopt", "dp=2 dist_opt=true", 2)],
          about="one multi-token prediction layer"),
    Group(name="mg-mtp-tied", framework="megatron-core", features="mtp_num_layers=1 model.tie_embeddings=true",
          candidates=[("pp2", "pp=2", 2), ("tp2", "tp=2", 2)],
          about="MTP with tied embeddings (the MTP stage's embedding and output layer)"),
    Group(name="mg-moe-aux", framework="megatron-core", moe=True,
          features=f"{MOE4} moe_aux_loss=aux_loss moe_z_loss_coeff=0.001",
          candidates=[("tp2-sp", "tp=2 sp=true", 2), ("dp2-ep2", "dp=2 ep=2", 2),
                      ("dp2-distopt", "dp=2 dist_opt=true", 2)],
          precisions=("fp32", "bf16"), about="4 experts top-2, allgather dispatcher, aux_loss 0.01, z-loss 0.001"),
    Group(name="mg-moe-a2a-seq", framework="megatron-core", moe=True,
          features=f"{MOE4} model.moe_dispatcher=alltoall moe_aux_loss=seq_aux_loss",
          candidates=[("tp2-sp", "tp=2 sp=true", 2), ("tp2", "tp=2", 2), ("dp2-ep2", "dp=2 ep=2", 2)],
          about="4 experts top-2, alltoall dispatcher, seq_aux_loss 0.01"),
    Group(name="mg-moe-global", framework="megatron-core", moe=True, features=f"{MOE4} moe_aux_loss=global_aux_loss",
          candidates=[("dp2", "dp=2", 2), ("tp2-sp", "tp=2 sp=true", 2)],
          about="4 experts top-2, allgather dispatcher, global_aux_loss 0.01"),
    Group(name="mg-moe-global-dp-scaled", framework="megatron-core", moe=True,
          features=f"{MOE4} moe_aux_loss=global_aux_loss moe_global_aux_loss_dp_scaled=true",
          candidates=[("dp2", "dp=2", 2)],
          about="control: global_aux_loss 0.01 scaled by the DP size as Megatron-LM#3769 proposes"),
    Group(name="mg-moe-per-token", framework="megatron-core", moe=True,
          features=f"{MOE4} moe_aux_loss=aux_loss moe_z_loss_coeff=0.001 per_token_loss=true",
          candidates=[("dp2-ep2", "dp=2 ep=2", 2), ("tp2", "tp=2", 2), ("tp2-sp", "tp=2 sp=true", 2)],
          about="MoE aux loss and z-loss with calculate_per_token_loss"),
    Group(name="mg-moe-shared", framework="megatron-core", moe=True,
          features=f"{MOE4} moe_shared_expert_size=64 moe_aux_loss=aux_loss",
          candidates=[("tp2-sp", "tp=2 sp=true", 2), ("dp2-ep2", "dp=2 ep=2", 2)],
          about="a shared expert beside 4 routed experts"),
    Group(name="mg-vpp", framework="megatron-core", features="", candidates=[("pp2-vpp2", "pp=2 vpp=2", 2)],
          about="virtual pipeline (interleaved 1F1B), 2 chunks per rank"),
    Group(name="mg-vpp-tied", framework="megatron-core", features="model.tie_embeddings=true",
          candidates=[("pp2-vpp2", "pp=2 vpp=2", 2)],
          about="virtual pipeline with tied embeddings (first chunk of rank 0, last chunk of rank 1)"),
    Group(name="tt-llama-ga", framework="torchtitan", features=TT_LLAMA, estimate_samples=2,
          candidates=[("fsdp2", TT_FSDP2, 2), ("tp2", TT_TP2, 2)],
          about="llama3 debug model, global batch 8 of local 2 (4 accumulation steps on one rank)"),
    Group(name="tt-qwen3-moe-ga", framework="torchtitan", features=TT_QWEN, moe=True, estimate_samples=2,
          candidates=[("fsdp2-ep2", TT_EP2, 2), ("fsdp2", TT_FSDP2, 2)],
          about="qwen3 MoE debug model (2 layers), 128 tokens, global batch 8 of local 2"),
    Group(name="tt-deepseek-ep", framework="torchtitan", features=TT_DEEPSEEK, moe=True, estimate_samples=2,
          candidates=[("fsdp2-ep2", TT_EP2, 2)],
          about="deepseek_v3 debug model (MLA, shared experts), 128 tokens, global batch 8 of local 2"),
    Group(name="hf-llama-ga", framework="transformers", features="--arch llama --micro-batches 2 --steps 1",
          estimate_samples=2, candidates=[("tp2", "--tp 2", 2)],
          about="transformers' own TP on a tiny Llama, 2 micro-batches per step"),
    Group(name="hf-qwen3-moe-ga", framework="transformers", features="--arch qwen3_moe --micro-batches 2 --steps 1",
          moe=True, estimate_samples=2, candidates=[("tp2", "--tp 2", 2)],
          about="transformers' own TP on a tiny Qwen3-MoE (q_norm/k_norm), 2 micro-batches per step"),
]


def _command(group: Group) -> str:
    return {"megatron-core": MEGATRON, "torchtitan": TORCHTITAN, "transformers": TRANSFORMERS}[group.framework]


def write_config(group: Group, work: Path) -> Path:
    """WORK/GROUP/check.toml: the user's config for the group (one reference, its candidates)."""
    directory = work / group.name
    directory.mkdir(parents=True, exist_ok=True)
    megatron = group.framework == "megatron-core"
    lines = [f"command = {json.dumps(_command(group))}", f"precisions = {json.dumps(list(group.precisions))}",
             f"cwd = {json.dumps(str(ROOT if megatron else directory))}", 'output = "out"',
             f"estimate_samples = {group.estimate_samples}", "timeout = 1500"]
    if megatron:
        lines.append('code = ["ttrace_examples/**/*.py"]')
    lines += ["", "[reference]", f"layout = {json.dumps(group.features)}"]
    for name, layout, world_size in group.candidates:
        lines += ["", "[[candidate]]", f"name = {json.dumps(name)}",
                  f"layout = {json.dumps((group.features + ' ' + layout).strip())}", f"world_size = {world_size}"]
    path = directory / "check.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_group(group: Group, work: Path) -> dict:
    config = write_config(group, work)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ttrace_core", "check", str(config), "--no-html"], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - started
    if done.returncode in (0, 1) and (config.parent / "out" / "check.json").is_file():
        return group_result(group, work, done.returncode, seconds)
    return {**asdict(group), "exit_code": done.returncode, "seconds": round(seconds, 1), "configurations": [],
            "error": (done.stderr or done.stdout)[-3000:]}


def group_result(group: Group, work: Path, exit_code: int, seconds: float) -> dict:
    """A group's row in the results, from the check.json its `ttrace check` wrote in WORK/GROUP/out."""
    result = {**asdict(group), "exit_code": exit_code, "seconds": round(seconds, 1), "configurations": []}
    check = json.loads((work / group.name / "out" / "check.json").read_text())
    for layout in check["layouts"]:
        coverage = layout.get("coverage") or {}
        result["configurations"].append({
            "name": layout["name"], "precision": layout["precision"], "layout": layout["layout"],
            "world_size": layout["world_size"], "outcome": layout["outcome"], "message": layout["message"],
            "first_divergence": layout["first_divergence"], "ratio": layout["ratio"], "culprit": layout["culprit"],
            "findings": layout["findings"][:5], "details": layout["details"][:6], "coverage": coverage,
            "log_tail": layout["log_tail"][-6:], "seconds": layout["seconds"]})
    return result


def compared(configuration: dict) -> str:
    """Tensors compared element-wise / tensors expected ('-' without a comparison)."""
    coverage = configuration.get("coverage") or {}
    if not coverage.get("tensors_expected"):
        return "-"
    return f"{coverage['compared_elementwise']}/{coverage['tensors_expected']}"


def markdown(results: dict) -> str:
    groups = results["groups"]
    configurations = [(g, c) for g in groups for c in g["configurations"]]
    outcomes = [c["outcome"] for _, c in configurations]
    lines = ["# `ttrace check` over feature combinations",
             "",
             "`python benchmarks/feature_matrix.py`: one `ttrace check` config per group (features on in the "
             "reference and every candidate), on 2 CPU cores shared with other jobs. " + results["versions"] + ". "
             "Code: " + results["tree"] + ".",
             "",
             f"- groups: {len(groups)}, configurations: {len(configurations)} "
             f"({outcomes.count('equivalent')} equivalent, {outcomes.count('not equivalent')} not equivalent, "
             f"{outcomes.count('error')} errors)",
             f"- groups whose check did not produce a result: {sum(1 for g in groups if not g['configurations'])}",
             *(f"- code of {', '.join(g['name'] for g in groups if g.get('tree', results['tree']) == tree)}: {tree}"
               for tree in dict.fromkeys(g.get("tree", results["tree"]) for g in groups)),
             f"- superseded results kept in the json (groups run again later): "
             f"{', '.join(g['name'] for g in results.get('superseded', [])) or 'none'}",
             "",
             "| group | framework | features | MoE | layout | precision | verdict | tensors compared | first divergence | ratio | culprit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for group in groups:
        if not group["configurations"]:
            lines.append(f"| {group['name']} | {group['framework']} | {group['about']} | {group['moe']} | - | - | "
                         f"check exit {group['exit_code']} | - | - | - | - |")
        for c in group["configurations"]:
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3g}"
            lines.append(f"| {group['name']} | {group['framework']} | {group['about']} | {group['moe']} | "
                         f"{c['name']} (`{c['layout']}`) | {c['precision']} | {c['outcome']} | {compared(c)} | "
                         f"{('`' + c['first_divergence'] + '`') if c['first_divergence'] else '-'} | {ratio} | "
                         f"{c['culprit'] or '-'} |")
    for group in groups:
        for c in group["configurations"]:
            if c["outcome"] != "equivalent":
                lines += ["", f"### {group['name']} / {c['name']} ({c['precision']}): {c['outcome']}", "",
                          c["message"], "", "```", *c["findings"], *c["details"], *c["log_tail"], "```"]
        if not group["configurations"]:
            lines += ["", f"### {group['name']}: no result", "", "```", group.get("error", ""), "```"]
    return "\n".join(lines) + "\n"


def tree() -> str:
    """Which code ran: the git commit of ROOT, or the TREE.txt a snapshot of it carries."""
    note = ROOT / "TREE.txt"
    if note.is_file():
        return note.read_text().strip()
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip()


def versions() -> str:
    import megatron.core
    import torch
    import torchtitan
    import transformers

    return (f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
            f"torchtitan {getattr(torchtitan, '__version__', '0.3.0')}, transformers {transformers.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="group names (default: every group)")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-feature-matrix"))
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the existing .json")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: rebuild the --only groups' rows from the check.json files already in --work "
                             "(after an interrupted run)")
    args = parser.parse_args()
    if args.render:
        results = json.loads((RESULTS / "feature_matrix.json").read_text())
        (RESULTS / "feature_matrix.md").write_text(markdown(results))
        return
    known = {g.name for g in GROUPS}
    if args.only and set(args.only) - known:
        parser.error(f"unknown group {sorted(set(args.only) - known)[0]!r}; known: {', '.join(sorted(known))}")
    json_path = RESULTS / "feature_matrix.json"
    previous = json.loads(json_path.read_text()) if args.only and json_path.is_file() else {}
    done = {g["name"]: g for g in previous.get("groups", [])}
    superseded = previous.get("superseded", [])
    """Earlier results of groups run again (e.g. before a ttrace fix), kept so that they can be quoted."""
    for group in GROUPS:
        if args.only and group.name not in args.only:
            continue
        print(f"== {group.name}", flush=True)
        if group.name in done:
            superseded.append(done[group.name])
        if args.collect:
            check = json.loads((args.work / group.name / "out" / "check.json").read_text())
            done[group.name] = {**group_result(group, args.work, check["exit_code"], check["seconds"]), "tree": tree()}
        else:
            done[group.name] = {**run_group(group, args.work), "tree": tree()}
        for c in done[group.name]["configurations"]:
            print(f"   {c['name']:16s} {c['precision']:5s} {c['outcome']:15s} {c['first_divergence']} {c['ratio']}",
                  flush=True)
        results = {"versions": versions(), "tree": tree(), "groups": [done[g.name] for g in GROUPS if g.name in done],
                   "superseded": superseded}
        RESULTS.mkdir(exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
        (RESULTS / "feature_matrix.md").write_text(markdown(results))


if __name__ == "__main__":
    main()
