"""The dashboard's page scripts, run by Streamlit (installed as ttrace_dashboard.views)."""
