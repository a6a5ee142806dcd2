"""Names of the target runtimes and weight formats, in one place and without importing torch (the CLI lists
them in its help before anything heavy is loaded). What they mean: :mod:`dartspec.targets`, :mod:`dartspec.quant`,
:mod:`dartspec.search`."""

RUNTIMES = ("auto", "lean", "hf")
QUANT_FORMATS = ("none", "fp16", "int8", "exact", "exact-a16")
QUANT_CHOICES = ("auto", *QUANT_FORMATS)
#: Drafters by name (:func:`dartspec.drafters.make_drafter`); ``none`` is plain decoding.
DRAFTER_NAMES = ("none", "pld", "dart", "dart+pld", "eagle3")
#: Tree builders for a parallel drafter's rows (:func:`dartspec.search.make_tree_builder`).
TREE_BUILDERS = ("beam", "ddtree", "chain")
#: Where ``data regenerate`` takes user turns from: ShareGPT conversations, or requests the target writes itself.
DATA_SOURCES = ("sharegpt", "self")
