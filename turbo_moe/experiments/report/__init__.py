"""The report: its data from the results stores (``data``), figures, the convergence analysis, drawing and writing it
(``report``), and drawing it from files and from the store to compare (``compare``)."""
