"""`quantizer ppl`: perplexity of a native checkpoint, streamed layer by layer."""

from quantizer.ppl.perplexity import PplResult, RowPredictions, perplexity, row_predictions, summarize

__all__ = ["PplResult", "RowPredictions", "perplexity", "row_predictions", "summarize"]
