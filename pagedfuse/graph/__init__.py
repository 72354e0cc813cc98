"""Generic helpers over Dynamo's torch-level FX graphs, shared by every pattern and the
rewrite engine: the op table (ops), the named-axes layout interpreter and its rule table
(layout), the alias/effects analysis (effects) and site questions (region)."""

from pagedfuse.graph import layout as layout  # registers the layout ops' spellings
