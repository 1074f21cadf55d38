"""Entry point of the ttrace dashboard: `ttrace dashboard ROOT` runs `streamlit run app/main.py`.

Every page is registered here with its URL path (/runs, /heatmap, /tensor); pages only lay out and
call `app` helpers, which reach the core through `ttrace_core.api`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `app` and `ttrace_core` without an install

import streamlit as st  # noqa: E402

from ttrace_dashboard.ui import navigation_pages, preload_charts, sidebar_links  # noqa: E402

st.set_page_config(page_title="ttrace", page_icon=":material/troubleshoot:", layout="wide")
current = st.navigation(navigation_pages(), position="hidden")
links = st.sidebar.empty()
with st.sidebar:
    preload_charts()  # while Runs shows, the heatmap's chart library loads
sidebar_links(links)  # drawn first, so a page that stops still has them
current.run()
sidebar_links(links)  # again, with the pair the page may have just written into the URL
