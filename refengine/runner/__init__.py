from refengine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
