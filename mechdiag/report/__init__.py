"""Plotly figures and the offline HTML report."""
