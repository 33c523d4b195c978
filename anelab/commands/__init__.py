"""The CLI's commands, one module each: ``setup_arg_parser(parser)`` adds its flags, ``main(args)`` runs it.

``anelab.cli`` holds the table (name -> module, one-line help) and imports only the module of the command
invoked, so each module imports what its command needs at its top. Nothing is imported here.
"""
