"""`python -m meshkit.plan_search`: the documented command for `meshkit.estimate.search`, kept as its name."""

import sys

from meshkit.estimate.search import Candidate, SearchResult, budget, family, layouts, main, render, search

__all__ = ["Candidate", "SearchResult", "budget", "family", "layouts", "main", "render", "search"]

if __name__ == "__main__":
    sys.exit(main())
