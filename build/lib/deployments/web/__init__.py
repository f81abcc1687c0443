"""The browser pages: Django templates, with live parts driven by static/gantry.js."""
