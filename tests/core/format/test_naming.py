"""format/naming.py: the naming conventions, each written once.

The rules' tables first; then a scan of the core and the dashboard (ttrace_core, app, pages) that
fails when one of these conventions is written again outside format/naming.py: a subtree test by
name prefix, the data-parallel axis names, the fp8 scale module's name, a rule on numbered name
components (the layer index), the embeddings' names or how the root module is shown.
"""

import ast
import re

import pytest

from ttrace_core.format import naming
from ttrace_core.format.naming import (
    DATA_PARALLEL_AXES, EMBEDDING_NAMES, FP8_SCALE_MODULE, ROOT_NAME, fp8_scale_linear, global_fqn, in_subtree, is_descendant, SubtreeIndex,
    layer_family,
)

from tests.support.paths import REPO

ROOT = REPO
SCANNED = ("ttrace_core", "app", "pages")
HOME = ROOT / "ttrace_core" / "format" / "naming.py"
ALLOWED = {
    ("ttrace_core/format/schema.py", "root name"): "ROOT_NAME is defined below naming.py, which re-exports it, "
                                                   "because a TensorKey's own text shows it",
    ("ttrace_core/record/command.py", "subtree"): "a Python module path (\"pkg.mod:function\"), not a module fqn",
}
"""(file, rule) -> why that file may write the rule itself."""


@pytest.mark.parametrize("fqn, root, expected", [
    ("a", "a", True), ("a.b", "a", True), ("a.b.c", "a", True), ("ab", "a", False), ("a", "a.b", False),
    ("layers.10.attn", "layers.1", False), ("x", "", True), ("x", None, True), ("", "", True),
    ("fc.weight", "fc", True),
], ids=["itself", "child", "grandchild", "shared-prefix", "parent", "layer-10-not-in-1", "root", "none", "root-itself",
        "parameter"])
def test_in_subtree_goes_by_whole_name_components(fqn, root, expected):
    assert in_subtree(fqn, root) is expected


@pytest.mark.parametrize("root", [None, "", "a", "a.b", "a-b", "b", "c", "a.b.c"])
def test_a_subtree_index_finds_what_in_subtree_holds(root):
    names = ["", "a", "a-b", "a.b", "a.b.c", "a.bc", "ab", "a/b", "b", "b.a", "a", "a.b"]
    index = SubtreeIndex((name, number) for number, name in enumerate(names))
    assert sorted(index.within(root)) == [number for number, name in enumerate(names) if in_subtree(name, root)]


@pytest.mark.parametrize("fqn, ancestor, expected", [
    ("a.b", "a", True), ("a", "a", False), ("ab", "a", False), ("a", "", True), ("", "", False),
], ids=["child", "itself", "shared-prefix", "root-holds-all", "root-itself"])
def test_is_descendant_is_in_subtree_without_itself(fqn, ancestor, expected):
    assert is_descendant(fqn, ancestor) is expected


@pytest.mark.parametrize("fqn, expected", [
    ("layers.1.attn", "layers.3.attn"), ("layers.1", "layers.3"), ("layers.10.attn", "layers.10.attn"),
    ("1.decoder", "decoder"), ("1", ""), ("emb", "emb"),
], ids=["child", "itself", "no-shared-prefix", "chunk-dropped", "chunk-root", "untouched"])
def test_global_fqn_renames_a_subtree(fqn, expected):
    assert global_fqn(fqn, (("layers.1", "layers.3"), ("1", ""))) == expected


@pytest.mark.parametrize("fqn, expected", [
    ("a.fc.fp8_scale_inv", "a.fc"), ("a.fc", None), ("a.fc.fp8_scale_inv.x", None), ("a.fc_fp8_scale_inv", None),
], ids=["scale", "linear", "below-scale", "suffix-without-dot"])
def test_fp8_scale_linear(fqn, expected):
    assert fp8_scale_linear(fqn) == expected


@pytest.mark.parametrize("fqn, expected", [
    ("decoder.layers.3.mlp.fc1", "decoder.layers.*.mlp.fc1"),
    ("layers.0.mlp.experts.2.w1", "layers.*.mlp.experts.*.w1"),
    ("decoder.layers.3", "decoder.layers.3"), ("final_norm", "final_norm"),
], ids=["layer", "layer-and-expert", "trailing-index-kept", "no-index"])
def test_layer_family(fqn, expected):
    assert layer_family(fqn) == expected


# --- the scan -------------------------------------------------------------------------------------

REGEX_FUNCTIONS = {"compile", "sub", "subn", "search", "match", "fullmatch", "findall", "finditer", "split"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name a convention; code may not)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _dict_keys(tree: ast.AST) -> set[int]:
    return {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys if key is not None}


def _prefix_with_dot(node: ast.AST) -> bool:
    """`x + "."` or f"{x}.": a name prefix tested by whole components, i.e. a subtree rule."""
    if isinstance(node, ast.Tuple):
        return any(_prefix_with_dot(element) for element in node.elts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return isinstance(node.right, ast.Constant) and node.right.value == "."
    if isinstance(node, ast.JoinedStr) and node.values:
        last = node.values[-1]
        return isinstance(last, ast.Constant) and str(last.value).endswith(".")
    return False


def convention_uses(source: str) -> list[tuple[str, int, str]]:
    """(rule, line, what) of every convention of format/naming.py the source writes itself."""
    tree = ast.parse(source)
    docstrings, dict_keys = _docstrings(tree), _dict_keys(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith") and node.args and _prefix_with_dot(node.args[0]):
                found.append(("subtree", node.lineno, ast.unparse(node)))
            if node.func.attr in REGEX_FUNCTIONS and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" \
                    and node.args and isinstance(node.args[0], ast.Constant) \
                    and re.search(r"\\\.\(?\\d", str(node.args[0].value)):
                found.append(("layer", node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == FP8_SCALE_MODULE:
            found.append(("fp8 scale", node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if FP8_SCALE_MODULE in node.value:
                found.append(("fp8 scale", node.lineno, repr(node.value)))
            if node.value in DATA_PARALLEL_AXES and id(node) not in dict_keys:
                found.append(("data parallel", node.lineno, repr(node.value)))
            if node.value in EMBEDDING_NAMES:
                found.append(("layer", node.lineno, repr(node.value)))
            if ROOT_NAME in node.value:
                found.append(("root name", node.lineno, repr(node.value)))
    return found


def test_no_naming_convention_is_written_outside_format_naming():
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == HOME or "__pycache__" in path.parts:
                continue
            relative = str(path.relative_to(ROOT))
            found += [f"{relative}:{line}: {rule}: {what}" for rule, line, what in convention_uses(path.read_text())
                      if (relative, rule) not in ALLOWED]
    assert found == [], "use format/naming.py (in_subtree, DATA_PARALLEL_AXES, FP8_SCALE_MODULE, layer_family, ...):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source, rule", [
    ('def f(fqn, root):\n    return fqn.startswith(root + ".")\n', "subtree"),
    ('def f(fqn, root):\n    return fqn.startswith(f"{root}.")\n', "subtree"),
    ('def f(name, c):\n    return name.startswith((c + ".", c + ":"))\n', "subtree"),
    ('def f(axes):\n    return "dp_shard" in axes\n', "data parallel"),
    ('def f(degrees):\n    return degrees.get("fsdp", 1)\n', "data parallel"),
    ('SUFFIX = ".fp8_scale_inv"\n', "fp8 scale"),
    ('class L:\n    def __init__(self):\n        self.fp8_scale_inv = None\n', "fp8 scale"),
    ('import re\nINDEX = re.compile(r"\\.\\d+\\.")\n', "layer"),
    ('NAMES = ("emb", "wte", "wpe")\n', "layer"),
    ('def f(fqn):\n    return f"{fqn or \'<root>\'}: failed"\n', "root name"),
], ids=["plus-dot", "f-string", "tuple", "dp-axis", "dp-degree", "fp8-string", "fp8-attribute", "layer-regex",
        "embedding-names", "root-name"])
def test_the_scan_sees_a_convention_written_again(source, rule):
    assert rule in {found_rule for found_rule, _, _ in convention_uses(source)}


@pytest.mark.parametrize("source", [
    'def f():\n    """Passes scales through `fp8_scale_inv`; dp and fsdp axes."""\n',
    'SIZES = {"dp": 2, "tp": 1}\n',
    'def f(path, folder):\n    return path.startswith(folder + "/")\n',
], ids=["docstring", "degrees-produced", "path-prefix"])
def test_the_scan_leaves_prose_and_produced_degrees_alone(source):
    assert convention_uses(source) == []


def test_the_home_itself_writes_each_rule():
    """The scan's patterns match the home's own code: a rule moved out of naming.py would be seen."""
    rules = {rule for rule, _, _ in convention_uses(HOME.read_text())}
    assert {"subtree", "fp8 scale", "data parallel", "layer"} <= rules, rules
    assert naming.display_fqn("") == naming.ROOT_NAME and naming.display_fqn("a.b") == "a.b"
    assert naming.__file__ == str(HOME)
