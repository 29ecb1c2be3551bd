"""Names in and out of the Hugging Face Hub: hub ids resolved through ``snapshot_download``
(``resolve``), and exports that plain ``transformers`` loads with ``trust_remote_code``
(``remote_code``; the self-contained ``modeling_mdlmpe.py`` copied into every export)."""
