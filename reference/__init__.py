"""The spec: model shapes, weights, the original (HF transformers) model, naive op references and the request
pipeline that the reference and the engine share. Nothing here is optimised; everything fast lives in `kernels/`
and `engine/` and is measured against what is here."""
