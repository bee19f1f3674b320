"""SGLang's ``/generate`` body, checked and parsed once, before anything reaches the engine."""
