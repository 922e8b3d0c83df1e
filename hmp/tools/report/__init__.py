"""hmp.audit's and hmp.tune's HTML report: the page (page.py), its charts (charts.py) and
the SVG they are drawn with (svg.py). Nothing is imported here, so sentences.py can read
svg's number format without loading the page."""
