"""The spec: model shapes, weights, the original (HF transformers) model, naive op references and the request
pipeline that the reference and the engine share. Nothing here is optimised; everything fast lives in `kernels/`
and `engine/` and is measured against what is here."""


def __getattr__(name: str):
    # `reference.decide(request) -> response`: the tiny-twin reference on the CPU, built once on first use.
    if name == "decide":
        from reference.service import decide

        return decide
    raise AttributeError(name)
