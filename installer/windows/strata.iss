; Inno Setup 6 script for Strata: a per-user installer with a Start-menu entry, an optional
; "start at login" task and an uninstaller. NOT TESTED: written on Linux, where Inno Setup and
; Windows were not available (see docs/getting-started.md).
;
; Build, from the repository root on Windows:
;   pip wheel --no-deps -w dist .
;   iscc installer\windows\strata.iss          -> dist\strata-setup.exe
;
; The setup carries Strata's wheel and install.ps1; at install time install.ps1 creates a
; virtualenv in {app}\venv with the user's Python 3.11+ (the `py` launcher), installs PyTorch
; from PyTorch's CUDA index and then the wheel. Python itself is not bundled.

#define AppName "Strata"
#define AppVersion "0.1.0"
#define Wheel "strata-" + AppVersion + "-py3-none-any.whl"

[Setup]
AppId={{5B0C7E0A-3E7C-4B8E-9A59-7A4C2F1D6E21}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Strata contributors
AppComments=Local LLM server in the tray that gives GPU memory back when other apps need it
DefaultDirName={localappdata}\Programs\Strata
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
OutputDir=..\..\dist
OutputBaseFilename=strata-setup
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
UninstallDisplayName={#AppName}
UninstallDisplayIcon={app}\strata.ico
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible

[Tasks]
Name: "autostart"; Description: "Start Strata when I log in"; Flags: unchecked
Name: "cpuonly"; Description: "No NVIDIA GPU: install the CPU build of PyTorch (smaller)"; Flags: unchecked

[Files]
Source: "install.ps1"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\dist\{#Wheel}"; DestDir: "{app}"; Flags: ignoreversion
Source: "..\..\LICENSE"; DestDir: "{app}"; Flags: ignoreversion skipifsourcedoesntexist

[Icons]
; pythonw: the tray opens no console window. strata.ico is rendered by install.ps1.
Name: "{autoprograms}\Strata"; Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; WorkingDir: "{app}"; IconFilename: "{app}\strata.ico"; Comment: "Local LLM server that shares the GPU"

[Run]
Filename: "powershell.exe"; \
  Parameters: "-NoProfile -ExecutionPolicy Bypass -File ""{app}\install.ps1"" -Prefix ""{app}"" -Source ""{app}\{#Wheel}"" -NoShortcut {code:TaskSwitches}"; \
  StatusMsg: "Installing Strata and PyTorch (several GB on the first install)..."; \
  Flags: waituntilterminated
Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m strata.app.main"; \
  Description: "Start Strata now"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; Removes the login entry and the virtualenv; Inno then removes the files it installed.
Filename: "powershell.exe"; \
  Parameters: "-NoProfile -ExecutionPolicy Bypass -File ""{app}\install.ps1"" -Uninstall -NoShortcut -Prefix ""{app}"""; \
  RunOnceId: "StrataUninstall"; Flags: runhidden waituntilterminated

[UninstallDelete]
Type: filesandordirs; Name: "{app}\venv"
Type: files; Name: "{app}\strata.ico"

[Code]
function TaskSwitches(Param: String): String;
begin
  Result := '';
  if WizardIsTaskSelected('autostart') then
    Result := Result + ' -Autostart';
  if WizardIsTaskSelected('cpuonly') then
    Result := Result + ' -CpuOnly';
end;
