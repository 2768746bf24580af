"""mkdocs hooks (mkdocs.yml `hooks:`): pages that may or may not exist yet join the nav at the
end when their file is there, so the strict build never fails on a page not written yet."""

from __future__ import annotations

import os

# (nav title, path under docs/) of the pages added at the end of the nav when present.
OPTIONAL_PAGES = (
  ("Budget rules", "budget_rules.md"),
  ("Rollout sources", "sources.md"),
  ("Decode scaling", "bench/decode_scaling.md"),
)


def on_config(config):
  """Appends every OPTIONAL_PAGES entry whose file exists to the nav."""
  present = [
    {title: path}
    for title, path in OPTIONAL_PAGES
    if os.path.exists(os.path.join(config["docs_dir"], path))
  ]
  if present:
    config["nav"] = [*config["nav"], {"More": present}]
  return config
