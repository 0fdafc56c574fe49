"""Numbers only: element formats, scaling layouts, quantize-dequantize, error metrics, the metric
table and hypothesis strategies. Imports nothing else of precision_suite (docs/architecture.md)."""
