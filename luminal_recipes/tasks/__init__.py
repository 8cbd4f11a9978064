"""Task plug-ins: each package here adds host steps (and the checks of the parameters and inputs they read) to
the pipeline driver; ``luminal_recipes/pipeline/plugins.py`` finds them by listing this folder and says what a
plug-in defines. ``flux2/``: FLUX.2 text-to-image (tokenizing, latents, the flow-match schedule); ``common/``:
steps any pipeline may use; ``generation/``: text generation with language-model recipes (`run`, ``--stdio``,
the Python API ``luminal_recipes.load_recipe``)."""
