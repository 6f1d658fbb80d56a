"""Where every millisecond of a step went: trace loading, span arithmetic, the per-device
breakdown, the report beside the cost model, capture during training, and the bench."""
