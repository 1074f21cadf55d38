import subprocess
import sys


def test_core_never_imports_ui_libraries():
    code = ("import sys, ttrace_core, ttrace_core.cli, ttrace_core.compare, ttrace_core.report, ttrace_core.tracer, "
            "ttrace_core.api, ttrace_core.table, ttrace_core.tensor_view, ttrace_core.dashboard; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('streamlit', 'plotly')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pages_reach_the_core_only_through_the_api():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in [*(root / "pages").glob("*.py"), *(root / "app").glob("*.py")]:
        imports = [line for line in script.read_text().splitlines() if line.startswith(("import ttrace_core", "from ttrace_core"))]
        allowed = ("from ttrace_core import api", "from ttrace_core.api import", "from ttrace_core.errors import",
                   "from ttrace_core.table import KINDS", "from ttrace_core.dashboard import ROOT_ENV")
        assert all(line.startswith(allowed) for line in imports), f"{script.name}: {imports}"
