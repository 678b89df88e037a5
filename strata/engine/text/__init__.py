"""Host-side text: tokenizer, chat template, incremental detokenizer and stop strings.

Never imports torch: the host tokenizes and templates while the model is unloaded.
"""

from strata.engine.text.assets import TextAssets, load_text_assets
from strata.engine.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from strata.engine.text.detokenizer import IncrementalDetokenizer
from strata.engine.text.errors import ChatTemplateError, TextAssetsError
from strata.engine.text.stop import StopMatcher

__all__ = [
    "CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer",
    "StopMatcher", "TextAssets", "TextAssetsError", "load_text_assets",
]
