"""Name lists for the gazetteer and for labelling public text: drug and
disease names read from terminology packages' data files
(``clinfed data names``)."""
