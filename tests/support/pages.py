"""The dashboard's pages in this process (streamlit.testing's AppTest), as a URL opens them.

Used by tests/app/test_pages.py, test_map_pages.py, test_localize_page.py and test_streamed_comparison.py."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from tests.support.paths import REPO

MAIN = str(REPO / "app" / "main.py")


def open_page(page: str, **params) -> AppTest:
    """The page ("runs", "heatmap", "tensor", "localize", "matrix") run once with these query parameters."""
    app = AppTest.from_file(MAIN, default_timeout=60)
    if page != "runs":
        app.switch_page(f"../pages/{page}.py")
    for name, value in params.items():
        app.query_params[name] = str(value)
    return app.run()


def url_of(app: AppTest) -> dict[str, str]:
    """The page's query parameters after it ran (what a copied link holds)."""
    return {name: value[0] if isinstance(value, list) else value for name, value in app.query_params.items()}


def errors_of(app: AppTest) -> list[str]:
    return [error.value for error in app.error]
