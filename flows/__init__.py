"""rlake's Prefect flows.

Prefect reads its settings when first imported, and ``flows.rl.rl_run`` called from Python
(not through the CLI, which sets the environment first) starts Prefect's own temporary server:
rlake's settings go in before any of this package imports Prefect, or that server keeps
Prefect's 20 s start-up limit, which a loaded two-core machine overran (CI, 2026-11-28)."""

from infra.env import set_offline_defaults

set_offline_defaults()
