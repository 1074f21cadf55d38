"""The ttrace dashboard (render stage): Streamlit pages over `ttrace_core.api`. Only this wing imports streamlit/plotly."""
