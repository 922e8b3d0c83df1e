"""Tools on the user's own model: audit, tune, profile, the HTML report, and
what they share (recording, the state guard, the loss, progress)."""
