"""The guards every public function and every run stand behind: the input checks that turn bad
input into a ValueError naming it (``checks``, ``inputs``), the memory arithmetic a run is sized by
(``memory``) and the model folders' checks (``model_folder``).

The bottom layer: it imports nothing from refppo; everything else may import it."""
