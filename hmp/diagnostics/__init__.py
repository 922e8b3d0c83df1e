"""What hmp says when something goes wrong: notes on dtype-mismatch errors
(errors, culprit) and warnings where hmp meets other precision machinery
(interop)."""
