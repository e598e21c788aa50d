# Re-export for recipes/dapo/weights.py (edited elsewhere); new code imports converters.table.
from converters.table import expand_table, split_row  # noqa: F401
