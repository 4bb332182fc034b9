"""Programs over several launches of one config (ablations, chaos trials) and what they read and draw:
their statistics, run store readers and figures."""
