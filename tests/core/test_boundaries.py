import subprocess
import sys


def test_core_never_imports_ui_libraries():
    code = ("import sys, ttrace_core, ttrace_core.cli.main, ttrace_core.compare.engine, ttrace_core.cli.report, ttrace_core.record.tracer, "
            "ttrace_core.api, ttrace_core.compare.table, ttrace_core.service.tensor_view, ttrace_core.service.dashboard; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('streamlit', 'plotly')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pages_reach_the_core_only_through_the_api():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in [*(root / "pages").glob("*.py"), *(root / "app").glob("*.py")]:
        imports = [line for line in script.read_text().splitlines() if line.startswith(("import ttrace_core", "from ttrace_core"))]
        allowed = ("from ttrace_core import api", "from ttrace_core.api import", "from ttrace_core.errors import")
        assert all(line.startswith(allowed) for line in imports), f"{script.name}: {imports}"


def test_importing_the_api_loads_no_torch_and_sets_no_warning_filter():
    """`python -X importtime -c "import ttrace_core.api"`: the facade the dashboard imports loads the stages
    (and torch behind them) only when a call needs them, and leaves the process's warning filters alone."""
    code = ("import warnings, numpy, pandas, msgspec; before = list(warnings.filters); "  # the libraries' own filters first
            "import ttrace_core, ttrace_core.api; print(warnings.filters == before)")
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "ttrace_core.api" in imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "streamlit", "plotly")}
    assert result.stdout.strip() == "True"


def test_the_lazy_root_still_gives_the_public_names():
    code = "import ttrace_core as t; print(t.attach.__module__, t.RunReader.__module__, t.compare_runs.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ttrace_core.record.session", "ttrace_core.format.reader", "ttrace_core.compare.engine"]
