"""rlake's Prefect tasks. rlake's Prefect settings go in before a task module imports Prefect,
for the reason flows/__init__.py gives."""

from infra.env import set_offline_defaults

set_offline_defaults()
