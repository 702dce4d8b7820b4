"""The model-free drafters and the drafter contract: `base.py` (`DrafterProtocol`, padding
helpers), `ngram.py` (prompt lookup), `suffix.py` (a suffix index over the request's and past
requests' tokens). They import nothing above numpy / torch, so the pool (models) and the
decoding layer both build on them."""
