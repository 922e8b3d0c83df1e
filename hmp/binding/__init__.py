"""What the lists say, decided once per ``convert()``: list files (lists,
list_files, refusals, uncast_list) -> the places ops live (resolve, aten,
spellings) -> which entries gain from the lower dtype (pays) -> each list's
record (kinds) -> what each site's wrapper will do (sites, picked) and what
each module entry does (module_entries, modules); imports resolves entries
of modules imported later. The calls themselves run in hmp/core/."""
