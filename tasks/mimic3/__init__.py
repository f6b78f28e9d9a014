"""MIMIC-III ICD-9 coding: CSV reader, CAML conventions, metrics, model adapter."""
