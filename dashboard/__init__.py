"""Streamlit dashboard for MFS: live server metrics and `mfs bench` results."""
