import subprocess
import sys


def test_core_never_imports_ui_libraries():
    code = ("import sys, ttrace_core, ttrace_core.cli, ttrace_core.compare, ttrace_core.report, ttrace_core.tracer; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('streamlit', 'plotly')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)
