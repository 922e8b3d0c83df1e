"""The cast pipeline and the state it keeps: list files (lists) -> the places
ops live (resolve) -> what each call casts (policy) -> the wrapper (wrap,
fallback, cache) -> the undo log (patch), driven by conversion; state holds
everything kept between calls, casts turns casting off and on for a block."""
